"""The SWE hidden tests' runner, and the subject process that holds the repository's code (stdlib only).

This file is *not* imported by the package; ``swe_tools`` reads its text and the sandbox's driver runs
it twice over: ``python -I -c <this> runner VERDICT_FD`` (the runner) starts ``python -c <this> subject``
(the subject) in the repository. The verdict is computed where the repository's code cannot reach it:

* the **runner** never imports repository code: it loads the hidden test modules from the text it is
  given on stdin (never from the disk the model wrote), makes their parent packages empty in-memory
  packages, and imports everything else of the repository as a *remote module*: attribute access and
  calls go to the subject over a pipe, and what comes back is **data** (None, bools, ints, floats,
  strings, bytes and lists/tuples/dicts/sets of them, rebuilt as the runner's own builtins) or an opaque
  handle (an object that is not data: attributes, calls, items, ``len``, iteration and ``str`` go to
  the subject; it has no truth value and compares by identity, so an object whose ``__eq__`` says yes
  to everything passes nothing). An exception raised there is raised here as the builtin of that name,
  or (a repository exception class) as a class made here under its name, below its builtin base.
  ``python -I``: neither the working folder nor the environment shape the runner's imports, so a
  ``unittest.py`` in the repository is the subject's business only.
* assertions run in the runner with unittest, and the counts go to the driver through a private pipe
  (``VERDICT_FD``, inherited by no other process), never through output the subject can write to.
* the runner is non-dumpable (``PR_SET_DUMPABLE`` 0): a process of the same uid can read neither its
  memory nor its file descriptors in ``/proc`` (the driver does the same).

Protocol (both ways): a 4-byte big-endian length, then JSON. Runner -> subject: ``{"op": "import",
"name"}``, ``{"op": "getattr", "ref", "name"}``, ``{"op": "call", "ref", "args", "kwargs"}``, ``{"op":
"getitem", "ref", "key"}``, ``{"op": "len" | "iter" | "str" | "repr", "ref"}``. Subject -> runner:
``{"value": V}`` or ``{"raise": {...}}``. A value V is JSON for None, bools, ints, finite floats and
strings, else a tagged object: ``{"float": repr}``, ``{"list"|"tuple"|"set"|"frozenset": [V...]}``,
``{"dict": [[V, V]...]}``, ``{"bytes": hex}``, ``{"ref": n, "type": name}``, ``{"exc_class": info}``.
"""

import builtins
import ctypes
import importlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
import types

PR_SET_DUMPABLE = 4
MAX_MESSAGE = 8 << 20
_BUILTIN_EXCEPTIONS = {name: cls for name, cls in vars(builtins).items()
                       if isinstance(cls, type) and issubclass(cls, BaseException)}


def _send(stream, message):
    data = json.dumps(message).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError("the other side closed the pipe")
    size = struct.unpack(">I", head)[0]
    if size > MAX_MESSAGE:
        raise ValueError("message of %d bytes" % size)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed the pipe")
    return json.loads(data)


class _Codec:
    """Values as the protocol's JSON: data as itself (tagged where JSON has no such type); anything else
    is the side's own business (``encode_other``: the subject's handles, the runner's refusal;
    ``decode_other``: a ``ref`` or ``exc_class`` object)."""

    def encode(self, value, depth=0):
        kind = type(value)  # exact types: a subclass (an int whose __eq__ lies) is not data
        if depth > 50:
            raise ValueError("value nested too deep to pass as data")
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if value == value and value not in (float("inf"), float("-inf")) else {"float": repr(value)}
        if kind in (list, tuple, set, frozenset):
            return {kind.__name__: [self.encode(v, depth + 1) for v in value]}
        if kind is dict:
            return {"dict": [[self.encode(k, depth + 1), self.encode(v, depth + 1)] for k, v in value.items()]}
        if kind is bytes:
            return {"bytes": value.hex()}
        return self.encode_other(value)

    def decode(self, value):
        if not isinstance(value, dict):
            return value
        if "ref" in value or "exc_class" in value:
            return self.decode_other(value)
        (tag, inner), = value.items()
        if tag == "float":
            return float(inner)
        if tag == "dict":
            return {self.decode(k): self.decode(v) for k, v in inner}
        if tag == "bytes":
            return bytes.fromhex(inner)
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](self.decode(v) for v in inner)


# -- the subject: the repository's code, behind the pipe ------------------------------------------------------------


def _exception_info(cls):
    builtin = next(c.__name__ for c in cls.__mro__ if _BUILTIN_EXCEPTIONS.get(c.__name__) is c)
    return {"module": cls.__module__, "qualname": cls.__qualname__, "builtin": builtin}


class _Subject(_Codec):
    def __init__(self):
        self.objects = {}

    def encode_other(self, value):
        if isinstance(value, type) and issubclass(value, BaseException):
            return {"exc_class": _exception_info(value)}
        self.objects[id(value)] = value
        return {"ref": id(value), "type": type(value).__qualname__}

    def decode_other(self, value):
        return self.objects[value["ref"]]

    def answer(self, request):
        op = request["op"]
        if op == "import":
            return importlib.import_module(request["name"])
        target = self.objects[request["ref"]]
        if op == "getattr":
            return getattr(target, request["name"])
        if op == "call":
            return target(*[self.decode(a) for a in request["args"]],
                          **{k: self.decode(v) for k, v in request["kwargs"].items()})
        if op == "getitem":
            return target[self.decode(request["key"])]
        if op == "len":
            return len(target)
        if op == "iter":
            return list(target)
        if op == "str":
            return str(target)
        if op == "repr":
            return repr(target)
        raise ValueError("unknown op %r" % op)

    def serve(self, requests, replies):
        while True:
            try:
                request = _receive(requests)
            except EOFError:
                return
            try:
                reply = {"value": self.encode(self.answer(request))}
            except BaseException as exc:  # noqa: BLE001 - reported to the runner, like any raise
                reply = {"raise": dict(_exception_info(type(exc)), message=str(exc)[:2000])}
            try:
                _send(replies, reply)
            except (TypeError, ValueError) as exc:
                _send(replies, {"raise": dict(_exception_info(type(exc)), message=str(exc)[:2000])})


# -- the runner: hidden tests and verdict, no repository code -------------------------------------------------------


class _Remote:
    """An object of the subject's: attributes, calls, items, len, iteration and str go there."""

    __slots__ = ("_link", "_ref", "_type")

    def __init__(self, link, ref, type_name):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", type_name)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._link.ask({"op": "getattr", "ref": self._ref, "name": name})

    def __call__(self, *args, **kwargs):
        link = self._link
        return link.ask({"op": "call", "ref": self._ref, "args": [link.encode(a) for a in args],
                         "kwargs": {k: link.encode(v) for k, v in kwargs.items()}})

    def __getitem__(self, key):
        return self._link.ask({"op": "getitem", "ref": self._ref, "key": self._link.encode(key)})

    def __len__(self):
        return int(self._link.ask({"op": "len", "ref": self._ref}))

    def __iter__(self):
        return iter(self._link.ask({"op": "iter", "ref": self._ref}))

    def __str__(self):
        return str(self._link.ask({"op": "str", "ref": self._ref}))

    def __repr__(self):
        return "<remote %s: %s>" % (self._type, self._link.ask({"op": "repr", "ref": self._ref}))

    def __bool__(self):
        raise TypeError("a %s of the code under test has no truth value here: the hidden tests compare data"
                        % self._type)

    def __setattr__(self, name, value):
        raise TypeError("the hidden tests cannot set attributes of the code under test's objects")


class _Link(_Codec):
    """The runner's end of the pipe to the subject."""

    def __init__(self, proc):
        self.proc = proc
        self.exception_classes = {}

    def ask(self, request):
        _send(self.proc.stdin, request)
        reply = _receive(self.proc.stdout)
        if "raise" in reply:
            raise self.exception(reply["raise"])(reply["raise"].get("message", ""))
        return self.decode(reply["value"])

    def exception(self, info):
        if info["module"] == "builtins" and info["qualname"] in _BUILTIN_EXCEPTIONS:
            return _BUILTIN_EXCEPTIONS[info["qualname"]]
        key = (info["module"], info["qualname"])
        if key not in self.exception_classes:
            base = _BUILTIN_EXCEPTIONS.get(info["builtin"], Exception)
            cls = type(info["qualname"].rsplit(".", 1)[-1], (base,), {"__module__": info["module"]})
            self.exception_classes[key] = cls
        return self.exception_classes[key]

    def encode_other(self, value):
        if type(value) is _Remote:
            return {"ref": value._ref}
        raise TypeError("the hidden tests can pass only data or the code under test's own objects to it, "
                        "not %s" % type(value).__name__)

    def decode_other(self, value):
        if "exc_class" in value:
            return self.exception(value["exc_class"])
        return _Remote(self, value["ref"], str(value.get("type", "object")))


class _HiddenTests:
    """Meta path finder: the hidden test modules from their text, their parents as empty packages."""

    def __init__(self, sources):
        self.sources = sources  # module name -> text
        self.packages = {".".join(name.split(".")[:i]) for name in sources for i in range(1, name.count(".") + 1)}

    def find_spec(self, name, path=None, target=None):
        if name in self.sources or name in self.packages:
            return importlib.util.spec_from_loader(name, self, is_package=name in self.packages)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ in self.sources:
            exec(compile(self.sources[module.__name__], "<hidden test %s>" % module.__name__, "exec"),
                 module.__dict__)


class _RemoteModules:
    """Meta path finder (last): a module of the repository's top-level names that nothing else finds,
    imported remotely. Never a standard-library name, nor one outside the repository: an optional
    import of the standard library that fails here must not be the subject's to answer."""

    def __init__(self, link, top_level):
        self.link = link
        self.top_level = set(top_level) - set(sys.stdlib_module_names)
        self.asking = False

    def find_spec(self, name, path=None, target=None):
        if self.asking or name.partition(".")[0] not in self.top_level:
            return None  # (asking: an import the protocol itself makes is the standard library's)
        self.asking = True
        try:
            remote = self.link.ask({"op": "import", "name": name})
        except ImportError:
            return None
        finally:
            self.asking = False
        spec = importlib.util.spec_from_loader(name, self, is_package=True)
        spec.loader_state = remote
        return spec

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        remote = spec.loader_state
        module.__getattr__ = lambda attr: getattr(remote, attr)  # PEP 562: every other attribute is remote
        return module

    def exec_module(self, module):
        pass


def run_hidden_tests(verdict_fd):
    """Run the hidden tests of the spec on stdin; write unittest's counts to ``verdict_fd``."""
    spec = json.loads(sys.stdin.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    import unittest

    # The subject's output (the repository's prints) joins the runner's log; never the verdict.
    proc = subprocess.Popen([sys.executable, "-c", spec["program"], "subject"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, close_fds=True)
    link = _Link(proc)
    sys.meta_path.insert(0, _HiddenTests(spec["sources"]))
    sys.meta_path.append(_RemoteModules(link, spec["top_level"]))
    suite = unittest.TestSuite()
    for name in spec["modules"]:
        suite.addTests(unittest.defaultTestLoader.loadTestsFromName(name))
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(suite)
    sys.stdout.flush()
    proc.kill()
    proc.wait()
    verdict = {"run": result.testsRun, "failures": len(result.failures), "errors": len(result.errors),
               "skipped": len(result.skipped), "unexpected_successes": len(result.unexpectedSuccesses)}
    with os.fdopen(verdict_fd, "w") as out:
        out.write(json.dumps(verdict))


def serve_repository():
    """The subject: answer the runner's requests (stdin -> stdout) with the repository's code, whose
    own reads and prints get /dev/null and stderr instead of the protocol's pipes."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdin, sys.stdout = open(os.devnull), sys.stderr
    _Subject().serve(requests, replies)


if __name__ == "__main__":
    if sys.argv[1] == "runner":
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # first: nothing of it readable in /proc
        run_hidden_tests(int(sys.argv[2]))
    else:
        serve_repository()
