"""The chat template's sandbox: a jinja2 `ImmutableSandboxedEnvironment` with what Hugging Face
templates expect, and the child process the HTTP server renders every chat prompt in.

A template is code from the model file (`tokenizer.chat_template`): it can loop for hours or build
gigabytes of text, and a Python thread cannot be stopped from outside. So the server renders in a
child (`python -m strata_dist.gguf_file.template_sandbox`, which imports jinja2 and nothing heavy), with an
address-space limit, an output bound checked as the template writes, and an alarm of its own; the
server kills it on its deadline or when the client leaves (strata_dist/server/templates.py).

The child speaks JSON lines on stdin/stdout. First line in: {"source": S}; out: {"ready": true} or
{"error": …, "kind": "template"}. Then per render, in: {"context": {...}, "max_chars": N,
"alarm_s": T}; out: {"text": …} or {"error": …, "kind": "template" | "output" | "memory"}."""
from __future__ import annotations

import json
from datetime import datetime


class TemplateError(ValueError):
    """A chat template that does not parse or fails on the messages; the message says why."""


class TemplateOutputLimit(TemplateError):
    """A chat template that wrote more than it may."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      separators=separators)


# names the renderer itself puts in a template's context: a request may not set them
CONTEXT_NAMES = ("messages", "add_generation_prompt", "tools", "bos_token", "eos_token")
GLOBAL_NAMES = ("raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner",
                "namespace")
# jinja2's own names inside a template
JINJA_NAMES = ("self", "loop", "caller", "varargs", "kwargs", "super", "true", "false", "none",
               "True", "False", "None")


def compile_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"],
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"the chat template does not parse: {e}") from None


def render_template(template, context: dict, max_chars: int | None = None) -> str:
    """The template's text for `context` (passed as one mapping: a key such as 'self' cannot
    collide with render's own arguments). With `max_chars`, TemplateOutputLimit as soon as the
    text passes it, checked piece by piece as the template writes."""
    import jinja2
    try:
        if max_chars is None:
            return template.render(context)
        out, n = [], 0
        for piece in template.generate(context):
            n += len(piece)
            if n > max_chars:
                raise TemplateOutputLimit(f"the chat template wrote more than {max_chars} "
                                          f"characters (the most this server's context takes)")
            out.append(piece)
        return "".join(out)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template failed: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, OverflowError) as e:
        raise TemplateError(f"the chat template failed on these messages: "
                            f"{type(e).__name__}: {e}") from None


# ---- the child process ---------------------------------------------------------------------------

def _reply(out, obj: dict) -> None:
    out.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
    out.flush()


def child_main(memory_bytes: int) -> int:
    import resource
    import signal
    import sys

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    # the address-space limit: a template that builds gigabytes meets MemoryError here, not the
    # server's memory
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    first = inp.readline()
    if not first:
        return 0
    try:
        template = compile_template(json.loads(first)["source"])
    except TemplateError as e:
        _reply(out, {"error": str(e), "kind": "template"})
        return 0
    _reply(out, {"ready": True})
    while True:
        line = inp.readline()
        if not line:            # the server is gone
            return 0
        req = json.loads(line)
        # the server kills a render at its deadline; the alarm ends this process even if the
        # server itself was killed meanwhile (its pipe would then only show at the next read)
        signal.setitimer(signal.ITIMER_REAL, float(req["alarm_s"]))
        try:
            text = render_template(template, req["context"], int(req["max_chars"]))
            reply = {"text": text}
        except TemplateOutputLimit as e:
            reply = {"error": str(e), "kind": "output"}
        except TemplateError as e:
            reply = {"error": str(e), "kind": "template"}
        except MemoryError:
            reply = {"error": f"the chat template used more than {memory_bytes >> 20} MiB",
                     "kind": "memory"}
        except RecursionError:
            reply = {"error": "the chat template recursed too deeply", "kind": "template"}
        except Exception as e:  # noqa: BLE001 - whatever a template does is its own failure
            reply = {"error": f"the chat template failed: {type(e).__name__}: {e}",
                     "kind": "template"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        del req
        _reply(out, reply)


if __name__ == "__main__":
    import sys
    sys.exit(child_main(int(sys.argv[1])))
