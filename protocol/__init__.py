"""strata-dist wire protocol: typed messages, codec, ZeroMQ transport, HMAC admission, CUDA IPC buffers.

Imports nothing else of this repository (docs/DEVELOPING.md, "Conventions"). The spec is PROTOCOL.md beside this file.
"""

from .messages import *  # noqa: F401,F403  (the message classes are the package's vocabulary)
from .messages import __all__ as _messages_all
from .codec import decode, encode
from .transport import (Channel, CurveKeys, Endpoints, PeerGone, Poller, ProtocolTimeout, RouterChannel,
                        advertise, new_curve_keypair, random_identity)
from .auth import AuthError, Authenticator, admit, client_handshake, load_secret, new_secret, write_secret

__all__ = list(_messages_all) + [
    "encode", "decode", "Channel", "RouterChannel", "Poller", "Endpoints", "CurveKeys", "ProtocolTimeout",
    "PeerGone", "advertise", "new_curve_keypair", "random_identity", "AuthError", "Authenticator", "admit",
    "client_handshake", "load_secret", "new_secret", "write_secret",
]
