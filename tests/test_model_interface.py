"""Each architecture module provides models/interface.py's Architecture, with the same parameter
names in every function (the rest of the product calls them by position and by name)."""
import inspect

import pytest

from strata_dist.models import ARCHITECTURES
from strata_dist.models.interface import Architecture

@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_modules_provide_the_interface(arch):
    module = ARCHITECTURES[arch]
    assert isinstance(module, Architecture)
    assert module.ARCH == arch and isinstance(module.ROUTER_PART, str)
    assert inspect.isclass(module.MODEL_CLASS)
    for name, member in vars(Architecture).items():
        if name.startswith("_") or not callable(member):
            continue
        want = list(inspect.signature(member).parameters)[1:]       # without self
        got = list(inspect.signature(getattr(module, name)).parameters)
        assert got == want, f"{arch}.{name}{tuple(got)}: the interface says {tuple(want)}"
