"""The test harness, run inside the sandbox as its main script (harness.py explains the design).

argv: run id, private input fd (JSON: the secret and the tests), private output fd (the verdict).
Trusted code; the candidate program is data (program.py in the working directory), run only in the
forked child. Nothing here may run, unpickle or compare an object the child made: it only ever
receives JSON and builds plain values from it (`decode`).
"""

import ast
import builtins
import ctypes
import importlib.util
import json
import os
import resource
import signal
import sys

MAX_REPLY = 8 << 20  # bytes of one reply from the child; a larger value fails its test
PARENT_HEADROOM = 256 << 20  # the parent's address space beyond what it holds at the fork
DEPTH = 200  # nesting of a value that still counts as plain data

# --- the wire format: JSON, with every non-JSON plain type tagged by a one-key object ----------------
PLAIN_SCALARS = (type(None), bool, int, str)


def encode(value, handle, depth=0):
    """Plain data (exact builtin types, deeply) as JSON; anything else through handle(value)."""
    kind = type(value)
    if depth > DEPTH:
        raise ValueError("nested too deeply")
    if kind in PLAIN_SCALARS:
        return value
    if kind is float:
        return {"float": value.hex()}
    if kind is complex:
        return {"complex": [value.real.hex(), value.imag.hex()]}
    if kind is bytes:
        return {"bytes": value.decode("latin-1")}
    if kind is list:
        return [encode(v, handle, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(v, handle, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in value.items()]}
    return handle(value)


def decode(data, resolve):
    """Plain values from JSON produced by `encode`; {"handle": n} through resolve(n)."""
    kind = type(data)
    if kind in PLAIN_SCALARS:
        return data
    if kind is list:
        return [decode(v, resolve) for v in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"malformed value {str(data)[:80]}")
    (tag, body), = data.items()
    if tag == "float" and type(body) is str:
        return float.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    if tag == "bytes" and type(body) is str:
        return body.encode("latin-1")
    if tag in ("tuple", "set", "frozenset") and type(body) is list:
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(v, resolve) for v in body)
    if tag == "dict" and type(body) is list:
        return {decode(k, resolve): decode(v, resolve) for k, v in body}
    if tag == "handle" and type(body) is int:
        return resolve(body)
    raise ValueError(f"malformed value {str(data)[:80]}")


def loads(line):
    def no_float(text):
        raise ValueError("untagged float")
    return json.loads(line, parse_float=no_float, parse_constant=no_float)


# --- the child: runs the program, then answers requests about its names ------------------------------

def serve(requests, replies):
    objects = []

    def handle(value):
        objects.append(value)
        return {"handle": len(objects) - 1}

    def answer(message):
        for stream in (sys.stdout, sys.stderr):  # what the program printed, before the parent ends us
            try:
                stream.flush()
            except BaseException:
                pass
        replies.write(json.dumps(message).encode() + b"\n")
        replies.flush()

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        with open("program.py") as f:
            exec(compile(f.read(), "program.py", "exec"), namespace)
        answer(["ok", None])
    except BaseException as e:  # SystemExit too: the program did not get to the tests
        answer(["error", f"the program raised {type(e).__name__}: {e}"[:1000]])
        os._exit(1)
    for line in requests:
        try:
            request = json.loads(line)
            if request[0] == "name":
                value = namespace[request[1]] if request[1] in namespace else _undefined(request[1])
            elif request[0] == "attr":
                value = getattr(objects[request[1]], request[2])
            else:
                value = objects[request[1]](*decode(request[2], objects.__getitem__),
                                             **decode(request[3], objects.__getitem__))
            reply = ["ok", encode(value, handle)]
        except BaseException as e:  # the test sees it as the nearest builtin exception (raised_here)
            reply = ["raised", *describe_exception(e)]
        answer(reply)
    os._exit(0)


def describe_exception(e):
    """(the builtin class it derives from, its message): str(e) for a builtin one, else prefixed with its class."""
    kind = type(e)
    builtin = next(c for c in kind.__mro__ if getattr(builtins, c.__name__, None) is c)
    try:
        text = str(e)
    except BaseException:  # a __str__ of the program's that fails
        text = ""
    return builtin.__name__, (text if kind is builtin else f"{kind.__name__}: {text}")[:1000]


def _undefined(name):
    raise NameError(f"name '{name}' is not defined by the program")


# --- the parent: runs the tests, with the program's names as stand-ins that ask the child ----------

class ChildFailed(Exception):
    """The child reported an error, or ended (exit, signal, limit) before answering."""


def raised_here(name, message):
    """What the program's code raised, as a test can catch it (`except ValueError:`, `except Exception:`): the
    builtin exception class it derives from, made here with its message; never one that is not an Exception
    (SystemExit, KeyboardInterrupt), which a test must not be able to catch by accident."""
    kind = getattr(builtins, name, None) if type(name) is str and type(message) is str else None
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        return ChildFailed(f"{message}" if type(message) is str else "malformed reply")
    for cls in kind.__mro__:  # UnicodeDecodeError takes five arguments: the nearest base that takes one message
        try:
            return cls(message)
        except TypeError:
            continue


class Channel:
    def __init__(self, requests, replies):
        self.requests, self.replies, self.remotes = requests, replies, {}

    def ask(self, request):
        self.requests.write(json.dumps(request).encode() + b"\n")
        self.requests.flush()
        return self.reply()

    def reply(self):
        line = self.replies.readline(MAX_REPLY)
        if not line.endswith(b"\n"):
            raise ChildFailed("the program's process ended before answering" if len(line) < MAX_REPLY
                              else f"a value larger than {MAX_REPLY} bytes")
        status, *body = loads(line)
        if status == "raised":
            raise raised_here(*body)
        if status != "ok":
            raise ChildFailed(str(body[0]))
        return decode(body[0], self.remote)

    def remote(self, number):
        if type(number) is not int:
            raise ValueError("malformed handle")
        return self.remotes.setdefault(number, Remote(self, number))

    def send(self, value):
        def handle(item):
            if type(item) is Remote and item._channel is self:
                return {"handle": item._number}
            raise TypeError(f"a {type(item).__name__} cannot be passed to the program")
        return encode(value, handle)


def _no_value(self, *args):
    raise TypeError("the program gave an object, not plain data (numbers, strings, bytes, None, lists, tuples, "
                    "sets, dicts of these): it cannot be compared or tested")


class Remote:
    """An object of the program's (a function, a class, an instance): it can be called and its
    attributes read, in the child; here it has no value: comparing it or its truth is an error."""
    __slots__ = ("_channel", "_number")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = __len__ = __iter__ = _no_value

    def __init__(self, channel, number):
        self._channel, self._number = channel, number

    def __call__(self, *args, **kwargs):
        return self._channel.ask(["call", self._number, self._channel.send(args), self._channel.send(kwargs)])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._channel.ask(["attr", self._number, name])

    def __repr__(self):
        return f"<the program's object {self._number}>"


def free_names(tree):
    bound, used = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(used - bound)


def importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def run_tests(tests, channel):
    """{"passed": tests passed before the first failure, "failure": why it failed or ""}."""
    try:
        channel.reply()  # the program's top level ran
    except Exception as e:
        return {"passed": 0, "failure": f"program: {e}"}
    for index, test in enumerate(tests):
        try:
            tree = ast.parse(test, f"test {index}")
            namespace = {"__builtins__": builtins, "__name__": "tests"}
            for name in free_names(tree):  # builtins and modules are the harness's own, never the program's
                namespace[name] = importlib.import_module(name) if importable(name) else channel.ask(["name", name])
            exec(compile(tree, f"test {index}", "exec"), namespace)
        except BaseException as e:
            return {"passed": index, "failure": f"test {index}: {type(e).__name__}: {e}"[:2000]}
    return {"passed": len(tests), "failure": ""}


def main():
    private_in, private_out = int(sys.argv[2]), int(sys.argv[3])
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no /proc/<us>/mem, fd or ptrace for the child
    child_requests, requests = os.pipe()
    replies, child_replies = os.pipe()
    child = os.fork()
    if child == 0:
        for fd in (private_in, private_out, requests, replies):
            os.close(fd)
        serve(os.fdopen(child_requests, "rb"), os.fdopen(child_replies, "wb"))
    os.close(child_requests)
    os.close(child_replies)
    with open("/proc/self/status") as f:
        size = int(next(line for line in f if line.startswith("VmSize:")).split()[1]) << 10
    limit, hard = size + PARENT_HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    spec = json.loads(os.pread(private_in, os.fstat(private_in).st_size, 0))  # only now: the child has no copy
    os.close(private_in)
    verdict = run_tests(spec["tests"], Channel(os.fdopen(requests, "wb"), os.fdopen(replies, "rb")))
    os.kill(child, signal.SIGKILL)
    os.write(private_out, json.dumps({"secret": spec["secret"], "total": len(spec["tests"]), **verdict}).encode())
    os._exit(0)


if __name__ == "__main__":
    main()
