"""LEAF / FedProx / pFedMe JSON reader, checked against `json.load` on small real files written in the format,
on every way such a file can be broken, on a ~20 MB file (correctness and peak memory), and on a pFedMe-style
Synthetic split."""
from __future__ import annotations

import gc
import json
import random
import re
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pfedkit.data.leaf import load_leaf, read_leaf_json
from pfedkit.data.sources import synthetic
from pfedkit.errors import DataError


# ---- helpers -------------------------------------------------------------------------------------------------------

def make_data(seed: int, num_users: int = 6, d: int = 5, max_n: int = 7, empty_user: bool = True) -> dict:
    """A dataset dict in the LEAF layout with float64 features (17 significant digits in the file), some ints and
    exponents among them, and (optionally) one user without samples."""
    rng = np.random.default_rng(seed)
    users = [f"f_{i:05d}" for i in range(num_users)]
    data = {"users": users, "num_samples": [], "user_data": {}}
    for i, u in enumerate(users):
        n = 0 if (empty_user and i == 2) else int(rng.integers(1, max_n + 1))
        x = rng.normal(0, 3, (n, d))
        x[:, 0] = np.round(x[:, 0])  # whole numbers (json writes them as 3.0)
        if n:
            x[0, -1] = 1.5e-7  # exponent notation
        rows = x.tolist()
        for row in rows:
            row[1] = int(round(row[1]))  # plain ints among the floats
        data["num_samples"].append(n)
        data["user_data"][u] = {"x": rows, "y": rng.integers(0, 10, n).tolist()}
    return data


def write_json(path: Path, data: dict, **kw) -> Path:
    with open(path, "w") as f:
        json.dump(data, f, **kw)
    return path


def reference(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What the reader must return, built with json.load."""
    with open(path) as f:
        data = json.load(f)
    users = data.get("users", list(data["user_data"]))
    rows = [row for u in users for row in data["user_data"][u]["x"][:1]]
    d = len(rows[0]) if rows else 0
    out = {}
    for u in users:
        with np.errstate(over="ignore"):  # huge values become inf, as float32(float(text)) does
            x = np.array(data["user_data"][u]["x"], dtype=np.float32).reshape(-1, d)
        out[u] = (x, np.array(data["user_data"][u]["y"], dtype=np.float64).astype(np.int64))
    return out


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for u in want:
        gx, gy = got[u]
        wx, wy = want[u]
        assert gx.dtype == np.float32 and gy.dtype == np.int64
        assert gx.shape == wx.shape
        np.testing.assert_array_equal(gx, wx)
        np.testing.assert_array_equal(gy, wy)


def data_error(fn, *args) -> str:
    with pytest.raises(DataError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ---- reading what json.dump writes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"separators": (",", ":")}, {"indent": 2}, {"indent": "\t", "sort_keys": True}],
                         ids=["default", "compact", "indent", "tabs-sorted"])
def test_matches_json_load(tmp_path, kw):
    path = write_json(tmp_path / "train.json", make_data(1), **kw)
    got = read_leaf_json(path)
    assert_same(got, reference(path))
    assert got["f_00002"][0].shape == (0, 5)  # the empty user keeps the feature dimension


def test_float64_text_rounds_like_json(tmp_path):
    """17-digit decimals, tiny/huge exponents, negative zero: the same float32 as json's float -> float32."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.normal(0, 1, (50, 8)), rng.normal(0, 1, (50, 8)) * 10.0 ** rng.integers(-40, 39, (50, 8))])
    x[0, 0] = -0.0
    x[0, 1] = 3.4028235677973366e38  # rounds to float32 max
    x[0, 2] = 1e-46  # underflows to 0 in float32
    data = {"users": ["a"], "num_samples": [100], "user_data": {"a": {"x": x.tolist(), "y": [1] * 100}}}
    path = write_json(tmp_path / "f.json", data)
    got = read_leaf_json(path)["a"][0]
    want = reference(path)["a"][0]
    assert got.tobytes() == want.tobytes()  # bit-exact, including the sign of zero


def test_hand_written_file_odd_whitespace_key_order_float_labels(tmp_path):
    text = (
        '\ufeff \r\n{ "hierarchies" :[ "a]b" , ["c", {"d": "}"}] , "e\\"]"],\n'
        '\t"user_data"\n:{\n'
        '  "bob" : { "y" : [ 3.0 ,1,\n 0.0 ] , "extra": {"x": [[9]]},\n'
        '      "x" :\n [ [ 1.5 , -2 ,3e2 ] ,\n\n[4,5,6],[ 7.25,\t8 , 9E-1 ]\n ] } ,\r\n'
        '  "al\\u00efce":{"x":[[0,0,0]],"y":[2]}, "carl": {"x": [ ], "y": [ ]}\n'
        '} , "num_samples" : [1, 3, 0],"users":["al\u00efce","bob","carl"]}  \n\n'
    )
    path = tmp_path / "odd.json"
    path.write_bytes(text.encode("utf-8"))
    got = read_leaf_json(path)
    assert list(got) == ["al\u00efce", "bob", "carl"]  # order of "users", not of "user_data"
    np.testing.assert_array_equal(got["bob"][0], np.array([[1.5, -2, 300], [4, 5, 6], [7.25, 8, 0.9]], np.float32))
    np.testing.assert_array_equal(got["bob"][1], [3, 1, 0])
    np.testing.assert_array_equal(got["al\u00efce"][0], np.zeros((1, 3), np.float32))
    assert got["carl"][0].shape == (0, 3) and got["carl"][1].shape == (0,)
    # the same file without the BOM agrees with json.load
    plain = tmp_path / "plain.json"
    plain.write_bytes(text[1:].encode("utf-8"))
    assert_same(read_leaf_json(plain), reference(plain))


def test_users_order_and_missing_users_key(tmp_path):
    data = make_data(2)
    data["users"] = data["users"][::-1]
    data["num_samples"] = data["num_samples"][::-1]
    assert list(read_leaf_json(write_json(tmp_path / "rev.json", data))) == data["users"]
    del data["users"], data["num_samples"]  # no list: user_data order
    data["user_data"] = dict(reversed(list(data["user_data"].items())))
    path = write_json(tmp_path / "nolist.json", data)
    got = read_leaf_json(path)
    assert list(got) == list(data["user_data"])
    assert_same(got, reference(path))


def test_rows_of_zero_features_and_all_empty(tmp_path):
    data = {"users": ["a", "b"], "user_data": {"a": {"x": [[], [], []], "y": [0, 1, 2]}, "b": {"x": [], "y": []}}}
    got = read_leaf_json(write_json(tmp_path / "f.json", data))
    assert got["a"][0].shape == (3, 0) and got["b"][0].shape == (0, 0)
    data = {"users": ["a"], "user_data": {"a": {"x": [], "y": []}}}
    assert read_leaf_json(write_json(tmp_path / "g.json", data))["a"][0].shape == (0, 0)


# ---- load_leaf -----------------------------------------------------------------------------------------------------

def test_load_leaf_order_groups_is_test(tmp_path):
    train, test = make_data(3), make_data(4, empty_user=False)
    test["users"] = test["users"][::-1]  # the test file's order must not matter
    test["num_samples"] = test["num_samples"][::-1]
    tr = write_json(tmp_path / "train.json", train)
    te = write_json(tmp_path / "test.json", test, separators=(",", ":"))
    x, y, groups, is_test, users = load_leaf(tr, te)
    assert users == train["users"]
    assert x.dtype == np.float32 and y.dtype == np.int64 and groups.dtype == np.int64 and is_test.dtype == bool
    ref_tr, ref_te = reference(tr), reference(te)
    want_x = np.concatenate([ref_tr[u][0] for u in users] + [ref_te[u][0] for u in users])
    want_y = np.concatenate([ref_tr[u][1] for u in users] + [ref_te[u][1] for u in users])
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)
    n_tr = sum(len(ref_tr[u][1]) for u in users)
    np.testing.assert_array_equal(is_test, np.arange(len(y)) >= n_tr)
    for k, u in enumerate(users):
        np.testing.assert_array_equal(x[(groups == k) & ~is_test], ref_tr[u][0].reshape(-1, 5))
        np.testing.assert_array_equal(y[(groups == k) & is_test], ref_te[u][1])
    assert np.all(np.diff(groups[~is_test]) >= 0) and np.all(np.diff(groups[is_test]) >= 0)


def test_pfedme_synthetic_round_trip(tmp_path):
    """pFedMe's generator layout: ids f_00000.., json.dump with default separators, each user split 90/10."""
    src = synthetic(0.4, 0.6, num_users=10, size_factor=1, seed=0)
    train = {"users": [], "user_data": {}, "num_samples": []}
    test = {"users": [], "user_data": {}, "num_samples": []}
    want_tr, want_te = [], []
    for k in range(10):
        xk, yk = src.x[src.groups == k], src.y[src.groups == k]
        cut = int(0.9 * len(yk))
        u = f"f_{k:05d}"
        for split, want, sl in ((train, want_tr, slice(0, cut)), (test, want_te, slice(cut, None))):
            split["users"].append(u)
            split["user_data"][u] = {"x": xk[sl].tolist(), "y": yk[sl].tolist()}
            split["num_samples"].append(len(yk[sl]))
            want.append((xk[sl], yk[sl]))
    tr = write_json(tmp_path / "mytrain.json", train)
    te = write_json(tmp_path / "mytest.json", test)
    x, y, groups, is_test, users = load_leaf(tr, te)
    assert users == [f"f_{k:05d}" for k in range(10)]
    np.testing.assert_array_equal(x, np.concatenate([a for a, _ in want_tr + want_te]))  # exact: float32 round trip
    np.testing.assert_array_equal(y, np.concatenate([b for _, b in want_tr + want_te]))
    sizes = [len(b) for _, b in want_tr + want_te]
    np.testing.assert_array_equal(groups, np.repeat(np.tile(np.arange(10), 2), sizes))  # train, then test
    np.testing.assert_array_equal(is_test, np.repeat([False] * 10 + [True] * 10, sizes))
    np.testing.assert_array_equal(np.sort(x[groups == 3], axis=0), np.sort(src.x[src.groups == 3], axis=0))


# ---- errors --------------------------------------------------------------------------------------------------------

def test_missing_file_and_not_this_layout(tmp_path):
    msg = data_error(read_leaf_json, tmp_path / "nope.json")
    assert "nope.json" in msg and "does not exist" in msg
    cases = {
        "empty.json": b"",
        "binary.json": bytes(range(256)),
        "text.json": b"users,num_samples\nf_0,3\n",
        "list.json": b"[1, 2, 3]",
        "other.json": b'{"a": 1, "b": [1, 2]}',
        "ud_list.json": b'{"users": [], "user_data": [1, 2]}',
        "trailing.json": b'{"user_data": {}} {"user_data": {}}',
        "users_ints.json": b'{"users": [1], "user_data": {"1": {"x": [[1]], "y": [0]}}}',
        "no_y.json": b'{"user_data": {"u": {"x": [[1]]}}}',
        "x_flat.json": b'{"user_data": {"u": {"x": [1, 2], "y": [0, 1]}}}',
        "x_3d.json": b'{"user_data": {"u": {"x": [[[1]]], "y": [0]}}}',
        "x_str.json": b'{"user_data": {"u": {"x": [["1", "2"]], "y": [0]}}}',
        "x_null.json": b'{"user_data": {"u": {"x": [[1, null]], "y": [0]}}}',
        "x_empty_val.json": b'{"user_data": {"u": {"x": [[1, , 2]], "y": [0]}}}',
        "x_trail_comma.json": b'{"user_data": {"u": {"x": [[1, 2,]], "y": [0]}}}',
        "x_no_comma.json": b'{"user_data": {"u": {"x": [[1, 2] [3, 4]], "y": [0, 1]}}}',
        "x_stray.json": b'{"user_data": {"u": {"x": [[1, 2], 5, [3, 4]], "y": [0, 1]}}}',
        "x_empty_row.json": b'{"user_data": {"u": {"x": [[1], [], [2]], "y": [0, 1, 2]}}}',
        "x_lead_comma.json": b'{"user_data": {"u": {"x": [[, 1, 2]], "y": [0]}}}',
        "y_empty_val.json": b'{"user_data": {"u": {"x": [[1], [2], [3]], "y": [0, , 2]}}}',
        "y_trail_comma.json": b'{"user_data": {"u": {"x": [[1], [2]], "y": [0, 1, ]}}}',
        "y_nested.json": b'{"user_data": {"u": {"x": [[1]], "y": [[0]]}}}',
        "y_str.json": b'{"user_data": {"u": {"x": [[1]], "y": ["0"]}}}',
        "y_frac.json": b'{"user_data": {"u": {"x": [[1]], "y": [0.5]}}}',
        "y_dict.json": b'{"user_data": {"u": {"x": [[1]], "y": {"a": 1}}}}',
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        msg = data_error(read_leaf_json, tmp_path / name)
        assert name in msg, msg
    assert "'user_data'" in data_error(read_leaf_json, tmp_path / "other.json")
    for name in ("no_y.json", "x_flat.json", "x_str.json", "y_str.json", "y_frac.json"):
        assert "'u'" in data_error(read_leaf_json, tmp_path / name)


@pytest.mark.parametrize("case, needle", [
    ("len_mismatch", "2 rows in 'x' but 3 labels"),
    ("num_samples", "'num_samples' says 5"),
    ("num_samples_len", "'num_samples' must be"),
    ("ragged_in_user", "row 1 has 2 values, row 0 has 3"),
    ("ragged_across", "rows of 4 values, other users have 3"),
    ("listed_missing", "listed in 'users' but has no entry"),
    ("unlisted", "not listed in 'users'"),
    ("dup_listed", "listed twice"),
    ("dup_entry", "appears twice in 'user_data'"),
])
def test_inconsistent_files_name_the_user(tmp_path, case, needle):
    ud = {"u0": {"x": [[1, 2, 3], [4, 5, 6]], "y": [0, 1]}, "u1": {"x": [[7, 8, 9]], "y": [2]}}
    data = {"users": ["u0", "u1"], "num_samples": [2, 1], "user_data": ud}
    text = None
    if case == "len_mismatch":
        ud["u1"]["x"].append([0, 0, 0]), ud["u1"]["y"].extend([0, 0])
        data["num_samples"] = [2, 3]
    elif case == "num_samples":
        data["num_samples"] = [2, 5]
    elif case == "num_samples_len":
        data["num_samples"] = [2]
    elif case == "ragged_in_user":
        ud["u1"]["x"].append([1, 2]), ud["u1"]["y"].append(0)
        data["num_samples"] = [2, 2]
    elif case == "ragged_across":
        ud["u1"]["x"] = [[1, 2, 3, 4]]
    elif case == "listed_missing":
        data["users"].append("u2"), data["num_samples"].append(0)
    elif case == "unlisted":
        data["users"], data["num_samples"] = ["u0"], [2]
    elif case == "dup_listed":
        data["users"].append("u1"), data["num_samples"].append(1)
    elif case == "dup_entry":
        text = json.dumps(data).replace('"u1": {', '"u1": {"x": [], "y": []}, "u1": {')
    path = tmp_path / f"{case}.json"
    if text is None:
        write_json(path, data)
    else:
        path.write_text(text)
    msg = data_error(read_leaf_json, path)
    assert needle in msg and path.name in msg, msg
    if case not in ("num_samples_len",):
        assert "'u1'" in msg or "'u2'" in msg, msg


def test_every_truncation_is_a_data_error(tmp_path):
    for kw, step in (({"separators": (",", ":")}, 1), ({}, 3), ({"indent": 1}, 5)):
        full = json.dumps(make_data(5, num_users=3, d=3, max_n=3), **kw).encode()
        path = tmp_path / "cut.json"
        for cut in list(range(0, len(full), step)) + [len(full) - 1]:
            path.write_bytes(full[:cut])
            data_error(read_leaf_json, path)
        path.write_bytes(full)
        read_leaf_json(path)


_STRING_OR_NUMBER = re.compile(r'"(?:[^"\\]|\\.)*"|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?')


def json_numbers(text: str) -> str:
    """Numbers outside strings rewritten the way JSON spells them ("1." -> "1.0", ".5" -> "0.5", "01" -> "1.0")."""
    def spell(m):
        if m.group()[0] == '"':
            return m.group()
        v = float(m.group())
        return repr(v) if np.isfinite(v) else ("1e999" if v > 0 else "-1e999")
    return _STRING_OR_NUMBER.sub(spell, text)


def test_random_corruption_never_gives_wrong_data(tmp_path):
    """Deleting, duplicating or replacing one byte: DataError, or exactly the data json.load reads from the file;
    never another exception. The one leniency: numbers in forms JSON forbids ("1.", ".5", "01") are read as such."""
    full = json.dumps(make_data(6, num_users=3, d=3, max_n=3))
    rnd = random.Random(0)
    path = tmp_path / "bad.json"
    outcomes = {"error": 0, "same": 0, "lenient": 0}
    for _ in range(600):
        i = rnd.randrange(len(full))
        op = rnd.choice(["del", "dup", "sub"])
        text = (full[:i] + full[i + 1:] if op == "del" else full[:i] + full[i] + full[i:] if op == "dup"
                else full[:i] + rnd.choice('[]{},:" 0-.e9xn') + full[i + 1:])
        path.write_text(text)
        try:
            got = read_leaf_json(path)
        except DataError:
            outcomes["error"] += 1
            continue
        try:
            json.loads(text)  # we accepted it, so it must be valid JSON ...
        except json.JSONDecodeError:  # ... up to the spelling of a number
            outcomes["lenient"] += 1
            path.write_text(json_numbers(text))
            json.loads(path.read_text())
        assert_same(got, reference(path))  # ... and we must return its data
        outcomes["same"] += 1
    assert outcomes["error"] > 100 and outcomes["same"] > 50, outcomes


def test_load_leaf_errors(tmp_path):
    base = make_data(8)
    tr = write_json(tmp_path / "train.json", base)
    fewer = make_data(8)
    del fewer["user_data"]["f_00004"]
    fewer["users"].remove("f_00004")
    del fewer["num_samples"]
    te_fewer = write_json(tmp_path / "test_fewer.json", fewer)
    msg = data_error(load_leaf, tr, te_fewer)
    assert "'f_00004'" in msg and "train.json" in msg and "test_fewer.json" in msg
    more = make_data(8)
    more["users"].append("zz")
    more["num_samples"].append(1)
    more["user_data"]["zz"] = {"x": [[0.0] * 5], "y": [1]}
    te_more = write_json(tmp_path / "test_more.json", more)
    msg = data_error(load_leaf, tr, te_more)
    assert "'zz'" in msg and "test_more.json" in msg
    wide = make_data(8, d=6)
    msg = data_error(load_leaf, tr, write_json(tmp_path / "test_wide.json", wide))
    assert "5" in msg and "6" in msg and "test_wide.json" in msg
    neg = make_data(8)
    neg["user_data"]["f_00001"]["y"][0] = -1
    msg = data_error(load_leaf, tr, write_json(tmp_path / "test_neg.json", neg))
    assert "negative label" in msg and "'f_00001'" in msg and "test_neg.json" in msg
    assert "missing.json" in data_error(load_leaf, tr, tmp_path / "missing.json")
    empty = {"users": ["a"], "user_data": {"a": {"x": [], "y": []}}}
    e = write_json(tmp_path / "e.json", empty)
    assert "no samples" in data_error(load_leaf, e, e)


@pytest.mark.parametrize("label", [10 ** 9, 100_000])
def test_a_huge_label_is_refused_before_anything_is_sized_by_it(tmp_path, label):
    # num_classes = max label + 1 sizes the model's output and the per-class counts: 10**9 would need ~37 GiB
    tr = write_json(tmp_path / "train.json", make_data(8))
    big = make_data(8)
    big["user_data"]["f_00003"]["y"][-1] = label
    te = write_json(tmp_path / "test_big.json", big)
    t0 = time.perf_counter()
    msg = data_error(load_leaf, tr, te)
    assert time.perf_counter() - t0 < 5
    distinct = len({v for d in (make_data(8), big) for u in d["users"] for v in d["user_data"][u]["y"]})
    assert "test_big.json" in msg and "'f_00003'" in msg and f"has label {label}," in msg, msg
    assert "N <= 100000" in msg and f"{distinct} distinct labels" in msg and f"renumber them 0..{distinct - 1}" in msg


def test_the_largest_label_allowed_loads(tmp_path):
    data = make_data(8)
    data["user_data"]["f_00000"]["y"][0] = 99_999
    path = write_json(tmp_path / "train.json", data)
    assert load_leaf(path, path)[1].max() == 99_999


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e39])  # 1e39: inf in float32
def test_non_finite_features_are_refused_naming_the_file_user_and_row(tmp_path, value):
    tr = write_json(tmp_path / "train.json", make_data(8))
    bad = make_data(8)
    rows = bad["user_data"]["f_00004"]["x"]
    assert len(rows) >= 2
    rows[1][2] = value  # json.dump writes NaN, Infinity, -Infinity, 1e+39
    te = write_json(tmp_path / "test_nan.json", bad)
    msg = data_error(load_leaf, tr, te)
    assert "test_nan.json" in msg and "'f_00004'" in msg and "non-finite features (NaN/inf" in msg, msg
    assert "in row 1;" in msg


def test_non_finite_features_through_load_source_stop_before_training(tmp_path):
    from pfedkit.config import DatasetConfig
    from pfedkit.data.sources import load_source
    data = make_data(8)
    data["user_data"]["f_00000"]["x"][0][0] = float("nan")
    path = write_json(tmp_path / "train.json", data)
    cfg = DatasetConfig(name="leaf", train_file=str(path), test_file=str(path))
    with pytest.raises(DataError, match=r"train\.json: user 'f_00000' holds non-finite features .* in row 0"):
        load_source(cfg, seed=0, num_clients=6)


# ---- a bigger file: correctness, memory --------------------------------------------------------------------------

def peak_bytes(fn) -> int:
    """Peak of the Python and numpy allocations (both are traced) while fn runs and its result is alive."""
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del result
    gc.collect()
    return peak


def test_big_file_correct_and_much_less_memory_than_json(tmp_path):
    """200 users x 200 samples x 60 features (~20 MB): same data as json.load, and a fraction of its peak memory."""
    rng = np.random.default_rng(0)
    users = [f"f_{i:05d}" for i in range(200)]
    data = {"users": users, "num_samples": [200] * 200, "user_data": {}}
    for u in users:
        x = np.round(rng.normal(0, 1, (200, 60)), 6)
        data["user_data"][u] = {"x": x.tolist(), "y": rng.integers(0, 10, 200).tolist()}
    path = write_json(tmp_path / "big.json", data)
    del data
    size = path.stat().st_size
    assert size > 15e6

    fast = peak_bytes(lambda: read_leaf_json(path))

    def with_json():
        with open(path) as f:
            return json.load(f)

    slow = peak_bytes(with_json)  # json.load alone, before any conversion to arrays
    t0 = time.perf_counter()
    got = read_leaf_json(path)
    t_fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    want = reference(path)
    t_ref = time.perf_counter() - t0
    assert_same(got, want)
    print(f"\nbig.json {size / 1e6:.1f} MB: read_leaf_json {t_fast:.2f} s, peak {fast / 1e6:.1f} MB; "
          f"json.load + arrays {t_ref:.2f} s, json.load peak {slow / 1e6:.1f} MB; memory ratio {fast / slow:.3f}")
    assert fast < 0.5 * slow
    assert fast < 1.6 * size  # the file's bytes, the float32 result, one user's text at a time


def test_a_leaf_dataset_runs_end_to_end_with_its_own_clients_and_split(tmp_path):
    """pFedMe's Synthetic files through `dataset.name: leaf`: its users become the clients, its split is kept."""
    from pfedkit.config import load_config
    from pfedkit.experiment import prepare, run_experiment
    from pfedkit.data.sources import synthetic
    src = synthetic(0.4, 0.6, num_users=6, size_factor=1, seed=3)
    train, test = {"users": [], "num_samples": [], "user_data": {}}, {"users": [], "num_samples": [], "user_data": {}}
    for u in range(6):
        x, y = src.x[src.groups == u], src.y[src.groups == u]
        cut = int(0.9 * len(y))
        for part, sl in ((train, slice(0, cut)), (test, slice(cut, None))):
            name = f"f_{u:05d}"
            part["users"].append(name)
            part["num_samples"].append(len(y[sl]))
            part["user_data"][name] = {"x": x[sl].tolist(), "y": y[sl].tolist()}
    (tmp_path / "train.json").write_text(json.dumps(train))
    (tmp_path / "test.json").write_text(json.dumps(test))
    cfg = load_config(None, ["dataset.name=leaf", f"dataset.train_file={tmp_path / 'train.json'}",
                             f"dataset.test_file={tmp_path / 'test.json'}", "partition.scheme=natural",
                             "partition.num_clients=6", "model.name=mlr", "rounds=2", "progress=false",
                             "plots=false", "local.steps=5", "local.batch_size=20"], "fedavg")
    data = prepare(cfg)
    assert data.num_clients == 6 and data.input_shape == (60,)
    for u in range(6):
        n = int((src.groups == u).sum())
        assert data.train_sizes[u] == int(0.9 * n) and data.test_sizes[u] == n - int(0.9 * n)
    run_experiment(cfg, tmp_path / "run", data=data, log=lambda s: None)
    assert (tmp_path / "run" / "fedavg" / "summary.json").is_file()
