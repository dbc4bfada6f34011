"""Reading user data files: JSONL, JSON, Parquet and local HF `datasets` directories.

Every record carries its origin ("file:line") so a bad record fails with an error that says where
it is and what is missing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from colo_rl.errors import DataError

log = logging.getLogger("colo_rl")


@dataclass
class Record:
    data: dict[str, Any]
    origin: str  # "path:line" (JSONL) or "path[row]" (Parquet / datasets)
    # Parquet / datasets: every row has every column, null where the record had no such key, so a
    # null is an absent key (JSON writes null on purpose)
    null_is_absent: bool = False

    def require(self, *keys: str) -> list[Any]:
        """The values of `keys`; a DataError naming the missing key and the record's origin."""
        out = []
        for key in keys:
            if key not in self.data:
                raise DataError(f"{self.origin}: missing key {key!r} (record has {sorted(self.data)}); "
                                f"fix or remove this record")
            if self.data[key] is None:
                raise DataError(f"{self.origin}: key {key!r} is null; fix or remove this record")
            out.append(self.data[key])
        return out

    def get(self, key: str) -> Any:
        """The value of `key`; a dotted key reads nested objects (verl's `reward_model.ground_truth`)."""
        value: Any = self.data
        for part in key.split("."):
            if not isinstance(value, dict) or value.get(part) is None:
                return None
            value = value[part]
        return value

    def has(self, key: str) -> bool:
        """Whether the record holds `key` (dotted: nested), null included."""
        value: Any = self.data
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return False
            if (value := value[part]) is None:
                return True
        return True

    def first_of(self, *keys: str, option: str = "") -> tuple[str, Any]:
        """The first of `keys` the record has (dotted: nested); a DataError naming them, and `option`
        (the setting that names another key), otherwise. The first key it has but holds null is an
        error too: falling back to a later key (`answer: null` to `solution`) would swap the
        truth without a word. From Parquet / datasets a null is an absent key."""
        for i, key in enumerate(keys):
            if (value := self.get(key)) is not None:
                return key, value
            if self.has(key) and not self.null_is_absent:
                later = [k for k in keys[i + 1:] if self.get(k) is not None]
                read = f", or set {option}={later[0]} to read its {later[0]!r}" if option and later else ""
                raise DataError(f"{self.origin}: key {key!r} is null; fill it in or remove the record{read}")
        hint = f"; or set {option}=<its key> (a.b for a nested one)" if option else ""
        raise DataError(
            f"{self.origin}: needs one of the keys {list(keys)} (record has {sorted(self.data)}){hint}"
        )


def wrong_type(origin: str, key: str, value: Any, expected: str) -> DataError:
    """The refusal of a value of a type the loaders cannot use (its Python text would become the
    prompt or the truth): names the record, the key and the type found, then `expected`."""
    return DataError(f"{origin}: key {key!r} is a {type(value).__name__}; {expected}")


def answer_text(value: Any, origin: str, key: str, hint: str = "") -> str:
    """A ground truth as text: a string, or a number's text (JSON 7 -> "7"); a list, object or bool
    is refused by `wrong_type`, `hint` (what else to do) after the expected types."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise wrong_type(origin, key, value, f"an answer is a string or a number{hint}")


class Records(list):
    """`read_records`' records, and the blank lines of a JSON Lines file it skipped: counted, and
    reported with the loader's line saying how many records it read."""

    def __init__(self, records: Iterable[Record] = (), blank_lines: int = 0):
        super().__init__(records)
        self.blank_lines = blank_lines

    def skipped(self) -> str:
        """"" or ", <n> blank line(s) skipped", to append to a loader's records line."""
        return f", {blank_lines_skipped(self.blank_lines)}" if self.blank_lines else ""


def blank_lines_skipped(n: int) -> str:
    """The words for `n` blank lines skipped, as the loaders report them."""
    return f"{n} blank line{'s' if n != 1 else ''} skipped"


PROJECT_ROOT = Path(__file__).resolve().parents[2]


NULL_MEANS = {"data.path": "the embedded task", "data.eval_path": "data.eval_size records of data.path held out"}


def resolve_data_path(path: str | Path, key: str = "data.path") -> Path:
    """A data file: as given (absolute, or relative to the current directory), else relative to the
    project root, so `data=gsm8k` works from any directory. Raises DataError saying where it looked."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    if not p.is_absolute() and (PROJECT_ROOT / p).exists():
        return PROJECT_ROOT / p
    where = f"{p.resolve()}" + ("" if p.is_absolute() else f" or {(PROJECT_ROOT / p).resolve()}")
    hint = (" data=gsm8k reads the GSM8K train split (JSONL, question / answer with '#### n') from "
            "../shared/data/gsm8k/train.jsonl beside the project; pass data.path=<your copy>."
            if "gsm8k" in str(path).lower() else f" Pass {key}=<a .jsonl / .json / .parquet file or a datasets "
                                                 f"directory>, or leave it null ({NULL_MEANS.get(key, '')}).")
    raise DataError(f"{key}={str(path)!r} does not exist (looked for {where}).{hint}")


def read_records(path: str | Path) -> Records:
    """Every record of a data file, with its origin, and the number of blank lines skipped."""
    p = resolve_data_path(path)
    records = _read_records(p, path)
    if not records:
        raise DataError(f"data.path={str(path)!r}: {p} holds no records (the file is empty)")
    warn_duplicate_ids(records, p)
    return records


def warn_duplicate_ids(records: list[Record], source: str | Path) -> int:
    """The number of records whose `id` repeats an earlier record's (compared as the text an
    example's id is), with a warning giving it and the first repeat's origin; not refused."""
    first_seen: dict[str, str] = {}
    repeats: list[tuple[Record, str]] = []
    for rec in records:
        if "id" in rec.data:
            rid = str(rec.data["id"])
            if rid in first_seen:
                repeats.append((rec, first_seen[rid]))
            else:
                first_seen[rid] = rec.origin
    if repeats:
        rec, first = repeats[0]
        log.warning("%s: %d records repeat an earlier record's id (first: %s, id %r as at %s); a per-problem "
                    "report (recipes/eval.py) names problems by id, so these cannot be told apart: give each "
                    "record an id of its own", source, len(repeats), rec.origin, str(rec.data["id"]), first)
    return len(repeats)


def _read_records(p: Path, path: str | Path) -> Records:
    if p.is_dir():
        return Records(_read_hf_dir(p))
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(p)
    if suffix == ".json":
        text = _utf8(p.read_bytes(), p)
        if text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno}); {JSON_FILE_IS}") from None
            return Records(_as_record(row, f"{p}[{i}]") for i, row in enumerate(rows))
        try:
            return _read_jsonl(p)
        except DataError:
            _refuse_one_object(p, text)  # a pretty-printed {"data": [...]}: say so, not "line 1: invalid JSON"
            raise
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        import pyarrow as pa

        try:
            rows = pq.read_table(p).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{p}: not a readable Parquet file ({e}); check the file, or give it the suffix of "
                            f"what it holds (.jsonl)") from None
        return Records(_as_record(row, f"{p}[row {i}]", columnar=True) for i, row in enumerate(rows))
    raise DataError(f"data.path={str(path)!r}: unsupported file type {suffix!r}; use .jsonl, .json, "
                    ".parquet or a directory saved with datasets.save_to_disk")


JSON_FILE_IS = "a .json file is one array of records ([{...}, {...}]) or JSON Lines (one record a line)"


def _refuse_one_object(p: Path, text: str) -> None:
    """A DataError when the .json file `p` (`text`) is one JSON object over several lines rather
    than records, naming its list-valued key (the records, most likely); None otherwise."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return
    if not isinstance(obj, dict):
        return
    lists = [k for k, v in obj.items() if isinstance(v, list)]
    if len(lists) == 1:
        key = lists[0]
        what = (f" Its key {key!r} holds a list of {len(obj[key])}: save that list as the file (python -c \"import "
                f"json, sys; json.dump(json.load(open(sys.argv[1]))[{key!r}], sys.stdout)\" {p.name} > records.json)")
    elif lists:
        what = f" Its keys {lists} hold lists: save the one with your records as the file"
    else:
        what = " For a single record, put it in [ ]"
    raise DataError(f"{p}: holds one JSON object (keys {sorted(obj)[:10]}), not records; {JSON_FILE_IS}.{what}")


def _utf8(raw: bytes, p: Path, lineno: int = 0) -> str:
    """`raw` (line `lineno` of `p`, or 0: the whole file) decoded as UTF-8, a leading byte-order
    mark dropped; or DataError naming the file, line and byte."""
    try:
        return raw.decode("utf-8-sig" if lineno <= 1 else "utf-8")
    except UnicodeDecodeError as e:
        at = lineno or raw[:e.start].count(b"\n") + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(f"{p}:{at}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); re-save the file "
                        f"as UTF-8") from None


def _read_jsonl(p: Path) -> Records:
    out = Records()
    with open(p, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = _utf8(raw, p, lineno)
            if not line.strip():  # counted: the loaders report it with the records they read
                out.blank_lines += 1
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                                "each line must be one JSON object") from None
            out.append(_as_record(row, f"{p}:{lineno}"))
    return out


def _as_record(row: Any, origin: str, columnar: bool = False) -> Record:
    if not isinstance(row, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(row).__name__}")
    return Record(row, origin, null_is_absent=columnar)


def _read_hf_dir(p: Path) -> list[Record]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001 - re-raised with the path and what to do
        raise DataError(f"data.path={str(p)!r}: not a directory saved with datasets.save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return [_as_record(row, f"{p}[row {i}]", columnar=True) for i, row in enumerate(ds)]
