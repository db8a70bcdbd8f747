"""Reader for the LEAF / FedProx / pFedMe federated JSON layout (one train file, one test file).

    {"users": ["f_00000", ...], "num_samples": [n0, ...],
     "user_data": {"f_00000": {"x": [[f, f, ...], ...], "y": [int, ...]}, ...}}

Keys may come in any order, other keys (LEAF's "hierarchies") are checked to be JSON and ignored, whitespace is
free, labels may be written as floats ("3.0"). Files reach hundreds of MB, so the bulk is never turned into Python
objects: the file is read once as bytes, a small scanner walks the JSON structure, and each user's "x" (a 2-D
list of numbers, which contains no quotes or braces) is located by bracket matching and converted by numpy in one
call. Small values ("users", "num_samples", anything unknown) go through `json`.

Peak memory is about the file size plus the float32 result (plus one user's text, a few times over, while it is
converted), against 3-8x the file size for `json.load` (one Python float object per number). Time is about that of
`json.load` alone: numpy's number parsing dominates.

Numbers are read by numpy's text parser, which is a little more lenient than JSON: it also takes forms such as
"1.", ".5", "+1", "01", "nan", "inf" (JSON's NaN and Infinity, which `json.dump` writes, are read as such).
Everything else that `json.load` would reject, or that is not this layout, is rejected.

Every problem is a `DataError` with a one-line message that names the file (and the user, where there is one).
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np

from ..errors import DataError

__all__ = ["read_leaf_json", "load_leaf"]

_WS = re.compile(rb"[ \t\n\r]*")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(rb"[^ \t\n\r,\]}]+")
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}"]', re.DOTALL)  # a lone '"' is an unterminated string
_ROWS_END = re.compile(rb"\][ \t\n\r]*\]")  # in a 2-D list of numbers only the last row's ']' is followed by ']'
# numpy's text parser reads a blank field ("1, ,2", "[1, ]", "[ ]") as -1 without complaint: in the (short) y lists
# such fields are found first by this pattern.
_EMPTY_FIELD = re.compile(rb"[\[,][ \t\n\r]*[,\]]")
_BRACKETS_TO_SPACE = bytes.maketrans(b"[]", b"  ")
_JSON_WS = b" \t\n\r"
_MAX_EXACT_INT = 2.0 ** 53
MAX_CLASSES = 100_000  # a label of 10**9 would size a 10**9-class output layer and one-hot / bincount arrays


class _Scanner:
    """Walks one file's bytes; every method takes a byte offset and returns the offset after what it read."""

    def __init__(self, buf: bytes, path: Path):
        self.buf = buf
        self.path = path
        self.n = len(buf)

    # ---- errors and primitives -----------------------------------------------------------------------------------

    def error(self, problem: str) -> DataError:
        return DataError(f"LEAF file {self.path}: {problem}")

    def syntax(self, pos: int, expected: str) -> DataError:
        if pos >= self.n:
            return self.error(f"ends early, at byte {self.n}, where {expected} was expected (truncated file?)")
        got = self.buf[pos:pos + 12].decode("utf-8", "replace")
        return self.error(f"malformed JSON at byte {pos}: expected {expected}, found {got!r}")

    def ws(self, pos: int) -> int:
        return _WS.match(self.buf, pos).end()

    def at(self, pos: int) -> bytes:
        return self.buf[pos:pos + 1]

    def expect(self, pos: int, char: bytes, expected: str) -> int:
        if self.buf[pos:pos + 1] != char:
            raise self.syntax(pos, expected)
        return pos + 1

    def string(self, pos: int, what: str) -> tuple[str, int]:
        m = _STRING.match(self.buf, pos) if self.at(pos) == b'"' else None
        if m is None:
            raise self.syntax(pos, what)
        try:
            return json.loads(m.group()), m.end()
        except (ValueError, UnicodeDecodeError):
            raise self.error(f"malformed string at byte {pos}") from None

    def value_end(self, pos: int, what: str) -> int:
        """End of the JSON value starting at `pos` (not checked beyond its extent; `value` checks it)."""
        c = self.at(pos)
        if c == b'"':
            return self.string(pos, what)[1]
        if c in (b"[", b"{"):
            depth = 0
            for m in _TOKENS.finditer(self.buf, pos):
                t = m.group()
                if t in (b"[", b"{"):
                    depth += 1
                elif t in (b"]", b"}"):
                    depth -= 1
                    if depth == 0:
                        return m.end()
                elif t == b'"':
                    break
            raise self.syntax(self.n, f"the end of {what}")
        m = _SCALAR.match(self.buf, pos)
        if m is None:
            raise self.syntax(pos, what)
        return m.end()

    def value(self, pos: int, what: str):
        """A small JSON value, decoded by `json`."""
        end = self.value_end(pos, what)
        try:
            return json.loads(self.buf[pos:end]), end
        except (ValueError, UnicodeDecodeError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise self.error(f"malformed {what} at byte {pos}: {msg}") from None
        except RecursionError:  # json's decoder recurses once per level of nesting
            raise self.error(f"{what} at byte {pos} nests lists or objects too deeply to read") from None

    def members(self, pos: int, what: str):
        """Yields (key, offset of its value) for each member of the object at `pos`; the consumer must send back
        the offset after that value. Returns the offset after the closing '}' through StopIteration.value."""
        pos = self.expect(pos, b"{", f"{what} (an object)")
        pos = self.ws(pos)
        if self.at(pos) == b"}":
            return pos + 1
        while True:
            key, pos = self.string(pos, f"a key in {what}")
            pos = self.ws(pos)
            pos = self.ws(self.expect(pos, b":", "':'"))
            pos = yield key, pos
            pos = self.ws(pos)
            c = self.at(pos)
            if c == b",":
                pos = self.ws(pos + 1)
            elif c == b"}":
                return pos + 1
            else:
                raise self.syntax(pos, f"',' or '}}' in {what}")

    def walk(self, pos: int, what: str, on_member) -> int:
        """Drives `members`: calls on_member(key, pos) -> end of value for each member; returns the end offset."""
        gen = self.members(pos, what)
        try:
            key, vpos = next(gen)
            while True:
                key, vpos = gen.send(on_member(key, vpos))
        except StopIteration as stop:
            return stop.value

    # ---- the numeric arrays --------------------------------------------------------------------------------------

    def numbers(self, text: bytes, dtype, count: int, problem: str) -> np.ndarray:
        """Parses comma-separated numbers (brackets already blanked), insisting on exactly `count` of them."""
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # numpy < 2 warns instead of raising
            try:
                vals = np.fromstring(text, dtype=dtype, sep=",")
            except (ValueError, DeprecationWarning):
                raise self.error(problem) from None
        if vals.size != count:
            raise self.error(problem)
        return vals

    def x_array(self, pos: int, user: str) -> tuple[np.ndarray | None, int]:
        """The user's "x" (a list of equal-length rows of numbers) as float32 (rows, d); None if it is []."""
        what = f"'x' of user {user!r}"
        pos = self.ws(self.expect(pos, b"[", f"{what} (a list of rows)"))
        if self.at(pos) == b"]":
            return None, pos + 1
        if self.at(pos) != b"[":
            raise self.syntax(pos, f"a row '[' in {what} (a list of rows of numbers)")
        m = _ROWS_END.search(self.buf, pos)
        if m is None:
            raise self.error(f"{what} has no closing ']]' (truncated file?)")
        inner = self.buf[pos:m.start() + 1]  # "[..], [..], ..., [..]"
        # The structure is checked on the text without whitespace ("[1,2],[3,4]"), with numpy on its byte codes.
        compact = inner.translate(None, _JSON_WS)
        codes = np.frombuffer(compact, dtype=np.uint8)
        starts = np.flatnonzero(codes == ord("["))
        ends = np.flatnonzero(codes == ord("]"))
        rows = len(starts)
        # rows "[...]" one after another, each pair separated by exactly one comma, nothing between them
        if (len(ends) != rows or (starts >= ends).any() or (starts[1:] != ends[:-1] + 2).any()
                or (codes[ends[:-1] + 1] != ord(",")).any()):
            raise self.error(f"{what} is not a list of rows of numbers (near byte {pos})")
        lengths = ends - starts  # 1 for an empty row
        if lengths[0] == 1:  # first row empty: all rows must be
            if (lengths != 1).any():
                raise self.error(f"{what}: row {int(np.argmax(lengths != 1))} is not empty, row 0 is "
                                 "(all rows must have the same length)")
            return np.zeros((rows, 0), dtype=np.float32), m.end()
        commas = np.flatnonzero(codes == ord(","))
        per_row = np.searchsorted(commas, ends) - np.searchsorted(commas, starts)
        d = int(per_row[0]) + 1
        if (per_row != d - 1).any() or (lengths == 1).any():
            i = int(np.argmax((per_row != d - 1) | (lengths == 1)))
            found = 0 if lengths[i] == 1 else int(per_row[i]) + 1
            raise self.error(f"{what}: row {i} has {found} values, row 0 has {d} "
                             "(all rows must have the same length)")
        # numpy's parser reads a blank field ("1, ,2") as -1: no comma may follow "[" or precede "," or "]"
        before, after = codes[commas - 1], codes[commas + 1]
        if (before == ord("[")).any() or (after == ord(",")).any() or (after == ord("]")).any():
            raise self.error(f"{what} has an empty value (near byte {pos})")
        del compact, codes, starts, ends, commas, before, after
        bad = f"{what} holds something other than comma-separated numbers (near byte {pos})"
        vals = self.numbers(inner.translate(_BRACKETS_TO_SPACE), np.float32, rows * d, bad)
        return vals.reshape(rows, d), m.end()

    def y_array(self, pos: int, user: str) -> tuple[np.ndarray, int]:
        what = f"'y' of user {user!r}"
        pos = self.expect(pos, b"[", f"{what} (a list of labels)")
        end = self.buf.find(b"]", pos)
        if end < 0:
            raise self.error(f"{what} has no closing ']' (truncated file?)")
        inner = self.buf[pos:end]
        bad = f"{what} must be a flat list of integer labels (near byte {pos - 1})"
        if not inner.strip(_JSON_WS):
            return np.zeros(0, dtype=np.int64), end + 1
        if b"[" in inner or _EMPTY_FIELD.search(self.buf, pos - 1, end + 1):
            raise self.error(bad)
        vals = self.numbers(inner, np.float64, inner.count(b",") + 1, bad)
        if not (np.isfinite(vals).all() and (np.floor(vals) == vals).all() and (np.abs(vals) < _MAX_EXACT_INT).all()):
            raise self.error(bad)
        return vals.astype(np.int64), end + 1

    # ---- the file ------------------------------------------------------------------------------------------------

    def user_entry(self, pos: int, user: str) -> tuple[np.ndarray | None, np.ndarray, int]:
        found: dict[str, np.ndarray | None] = {}

        def member(key: str, vpos: int) -> int:
            if key == "x":
                found["x"], end = self.x_array(vpos, user)
            elif key == "y":
                found["y"], end = self.y_array(vpos, user)
            else:  # not needed, but checked to be JSON
                end = self.value(vpos, f"'{key}' of user {user!r}")[1]
            return end

        end = self.walk(pos, f"the entry of user {user!r}", member)
        for key in ("x", "y"):
            if key not in found:
                raise self.error(f"user {user!r} has no {key!r} in 'user_data'")
        return found["x"], found["y"], end

    def parse(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if self.n == 0:
            raise self.error("file is empty")
        pos = self.ws(3 if self.buf.startswith(b"\xef\xbb\xbf") else 0)
        if self.at(pos) != b"{":
            raise self.error("not a LEAF/FedProx JSON file (it does not start with a JSON object '{')")
        top: dict = {}
        data: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}

        def user_member(user: str, vpos: int) -> int:
            if user in data:
                raise self.error(f"user {user!r} appears twice in 'user_data'")
            x, y, end = self.user_entry(vpos, user)
            data[user] = (x, y)
            return end

        def top_member(key: str, vpos: int) -> int:
            if key in top:
                raise self.error(f"key {key!r} appears twice")
            if key == "user_data":
                top[key] = True
                return self.walk(vpos, "'user_data'", user_member)
            if key in ("users", "num_samples"):
                top[key], end = self.value(vpos, f"'{key}'")
                return end
            top[key] = None  # e.g. LEAF's "hierarchies": not needed, but checked to be JSON
            return self.value(vpos, f"the value of {key!r}")[1]

        end = self.ws(self.walk(pos, "the top-level object", top_member))
        if end != self.n:
            raise self.syntax(end, "the end of the file after the top-level object")
        return self.check(top, data)

    def check(self, top: dict, data: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if "user_data" not in top:
            raise self.error("no 'user_data' key (not a LEAF/FedProx/pFedMe dataset file)")
        users = top.get("users")
        if users is None:
            users = list(data)
        else:
            if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
                raise self.error("'users' must be a list of user names")
            if len(set(users)) != len(users):
                dup = next(u for i, u in enumerate(users) if u in users[:i])
                raise self.error(f"user {dup!r} is listed twice in 'users'")
            for u in users:
                if u not in data:
                    raise self.error(f"user {u!r} is listed in 'users' but has no entry in 'user_data'")
            if len(data) != len(users):
                listed = set(users)
                extra = next(u for u in data if u not in listed)
                raise self.error(f"user {extra!r} has an entry in 'user_data' but is not listed in 'users'")
        num_samples = top.get("num_samples")
        if num_samples is not None:
            if (not isinstance(num_samples, list) or len(num_samples) != len(users)
                    or not all(isinstance(k, int) and not isinstance(k, bool) for k in num_samples)):
                raise self.error(f"'num_samples' must be a list of {len(users)} integers, one per user")
        dims = {x.shape[1] for x, _ in data.values() if x is not None and len(x)}
        if len(dims) > 1:
            d0 = next(x.shape[1] for x, _ in data.values() if x is not None and len(x))
            u = next(u for u, (x, _) in data.items() if x is not None and len(x) and x.shape[1] != d0)
            raise self.error(f"user {u!r} has rows of {data[u][0].shape[1]} values, other users have {d0} "
                             "(all rows must have the same length)")
        d = dims.pop() if dims else 0
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for i, u in enumerate(users):
            x, y = data[u]
            if x is None or len(x) == 0:
                x = np.zeros((0, d), dtype=np.float32)
            if len(x) != len(y):
                raise self.error(f"user {u!r} has {len(x)} rows in 'x' but {len(y)} labels in 'y'")
            if num_samples is not None and num_samples[i] != len(y):
                raise self.error(f"user {u!r} has {len(y)} samples but 'num_samples' says {num_samples[i]}")
            out[u] = (x, y)
        return out


def read_leaf_json(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One LEAF/FedProx/pFedMe JSON file -> {user: (x float32 (n_u, d), y int64 (n_u,))}.

    Users come in the order of the file's "users" list (or of "user_data" when there is no such list). Users with
    no samples get x of shape (0, d). Raises DataError if the file is missing, truncated, not of this layout, or
    inconsistent (len(x) != len(y), "num_samples" disagreeing, rows of different lengths).
    """
    path = Path(path)
    try:
        buf = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"LEAF file {path} does not exist") from None
    except OSError as e:
        raise DataError(f"LEAF file {path} cannot be read: {e.strerror or e}") from None
    return _Scanner(buf, path).parse()


def load_leaf(train_path: str | Path, test_path: str | Path
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """A train file and a test file -> (x, y, groups, is_test, users).

    Sample order: every user's train samples (users in the train file's order), then every user's test samples
    (same user order). x float32 (N, d), y int64 (N,), groups int64 (N,) the index of the sample's user in `users`,
    is_test bool (N,). Both files must hold the same users, rows of the same length, finite features (JSON's NaN and
    Infinity are read, then refused here) and labels 0..MAX_CLASSES-1.
    """
    train_path, test_path = Path(train_path), Path(test_path)
    train = read_leaf_json(train_path)
    test = read_leaf_json(test_path)
    users = list(train)
    for u in users:
        if u not in test:
            raise DataError(f"LEAF files: user {u!r} is in {train_path} but not in {test_path}")
    if len(test) != len(train):
        u = next(u for u in test if u not in train)
        raise DataError(f"LEAF files: user {u!r} is in {test_path} but not in {train_path}")
    dims = {}
    for path, split in ((train_path, train), (test_path, test)):
        for u in users:
            x, y = split[u]
            if len(x):
                dims.setdefault(x.shape[1], (path, u))
            if len(y) and y.min() < 0:
                raise DataError(f"LEAF file {path}: user {u!r} has a negative label ({y.min()}); labels must be >= 0")
            if len(y) and y.max() >= MAX_CLASSES:  # labels size the model's output and per-class counts
                distinct = len(np.unique(np.concatenate([s[v][1] for s in (train, test) for v in users])))
                raise DataError(f"LEAF file {path}: user {u!r} has label {y.max()}, but labels must be 0..N-1 with "
                                f"N <= {MAX_CLASSES} classes (the files hold {distinct} distinct labels); "
                                f"renumber them 0..{distinct - 1}")
            finite = np.isfinite(x).all(axis=1)
            if not finite.all():  # would train to NaN and look like a too-large learning rate
                raise DataError(f"LEAF file {path}: user {u!r} holds non-finite features (NaN/inf, or beyond "
                                f"float32's range) in row {int(np.argmin(finite))}; fix or drop that row")
    if len(dims) > 1:
        (d0, (p0, u0)), (d1, (p1, u1)) = list(dims.items())[:2]
        raise DataError(f"LEAF files: user {u0!r} in {p0} has rows of {d0} values but user {u1!r} in {p1} has {d1}")
    d = next(iter(dims)) if dims else 0
    sizes = np.array([len(split[u][1]) for split in (train, test) for u in users], dtype=np.int64)
    n = int(sizes.sum())
    if n == 0:
        raise DataError(f"LEAF files {train_path} and {test_path} hold no samples")
    x = np.empty((n, d), dtype=np.float32)  # filled in place, each user's arrays freed once copied
    y = np.empty(n, dtype=np.int64)
    offset = 0
    for split in (train, test):
        for u in users:
            xu, yu = split.pop(u)
            x[offset:offset + len(yu)] = xu
            y[offset:offset + len(yu)] = yu
            offset += len(yu)
    num_users = len(users)
    groups = np.tile(np.arange(num_users, dtype=np.int64), 2).repeat(sizes)
    is_test = np.repeat(np.array([False, True]), [int(sizes[:num_users].sum()), int(sizes[num_users:].sum())])
    return x, y, groups, is_test, users
