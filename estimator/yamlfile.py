"""Reading the YAML files users hand to Frenzy (job, cluster, workload mix): one safe loader.

    data = load_yaml("job.yaml", kind=JOB_FILE)        # a LineDict, or FrenzyInputError
    line_of(data, "seq_len")                            # 4: where the key was written

Every failure is one ``FrenzyInputError`` line naming the file (and the line where there is
one), raised before the document is built, so nothing downstream ever sees a hostile file:

- larger than ``MAX_BYTES``, not a regular file, or not UTF-8 text;
- not valid YAML (the line of the problem), or a key written twice in one mapping;
- aliases that expand to more than ``MAX_VALUES`` values (a "billion laughs" bomb composes in
  microseconds as a graph of shared nodes; what explodes is whatever walks the built document,
  e.g. validation), or that refer to themselves;
- with ``kind``: a document of another kind (a cluster file given as a workload mix) or of no
  known kind, named as such.

Mappings come back as ``LineDict`` (a dict that also knows its own line and each key's line),
so validators can point at the line of the field they reject.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import FrenzyInputError

# The largest legitimate input is a cluster file that lists an address for every node at the
# cluster limits (32,768 nodes x ~20 bytes, about 0.7 MB); job and mix files are a few hundred
# bytes. 2 MiB leaves room for comments and still parses in well under a second with libyaml.
MAX_BYTES = 2 * 1024 * 1024
# Values after alias expansion: that same cluster file has ~33,000 scalars; 10x of headroom.
MAX_VALUES = 330_000


@dataclass(frozen=True, slots=True)
class FileKind:
    """One kind of Frenzy input file, told apart by the top-level keys only it has."""

    name: str                   # "workload mix"
    keys: tuple[str, ...]       # top-level keys no other kind has; a document of this kind has one
    example: str                # the example file to point the user at


JOB_FILE = FileKind("job file", ("model", "init_from"), "examples/tiny-job.yaml")
CLUSTER_FILE = FileKind("cluster file", ("pools", "gpu_types"), "examples/cluster.yaml")
WORKLOAD_MIX = FileKind("workload mix", ("reference_gpu", "classes"), "examples/workload-mix.yaml")
KINDS = (JOB_FILE, CLUSTER_FILE, WORKLOAD_MIX)


class LineDict(dict):
    """A mapping from a YAML file: ``line`` is where it starts, ``key_lines[key]`` where each
    key was written (1-based)."""

    line: int = 0
    key_lines: dict[str, int] = {}


def line_of(obj: Any, key: str | None = None) -> int | None:
    """The line of ``key`` in ``obj`` (or of ``obj`` itself) when ``obj`` came from a file."""
    if isinstance(obj, LineDict):
        if key is not None and key in obj.key_lines:
            return obj.key_lines[key]
        return obj.line
    return None


_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)     # libyaml when present: fast, bounded nesting


class _Loader(_Base):  # type: ignore[misc, valid-type]
    """A safe loader whose mappings are ``LineDict`` and refuse a key written twice."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LineDict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, line, seen[key])
            seen[key] = line
    mapping = LineDict(loader.construct_mapping(node, deep=True))
    mapping.line = node.start_mark.line + 1
    mapping.key_lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return mapping


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int):
        self.key, self.line, self.first = key, line, first


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _expanded_size(root: yaml.Node, source: str) -> int:
    """How many values the document has once every alias is expanded (iterative, memoised per
    node: linear in the size of the node graph, however large the expansion)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        nid = id(node)
        if children_done:
            on_path.discard(nid)
            kids = _children(node)
            size[nid] = 1 + sum(size[id(k)] for k in kids)
            if size[nid] > MAX_VALUES:
                raise FrenzyInputError(f"{source} line {node.start_mark.line + 1}",
                                       f"aliases expand to more than {MAX_VALUES:,} values (an alias bomb?)")
            continue
        if nid in size:
            continue
        on_path.add(nid)
        stack.append((node, True))
        for k in _children(node):
            if id(k) in on_path:
                raise FrenzyInputError(f"{source} line {k.start_mark.line + 1}", "an alias refers to itself")
            if id(k) not in size:
                stack.append((k, False))
    return size[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def parse_yaml(text: str, source: str = "input", kind: FileKind | None = None) -> Any:
    """Parse YAML ``text`` safely (see the module docstring); ``source`` names it in errors."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _expanded_size(node, source)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        ctx, ctx_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if ctx and ctx_mark is not None and mark is not None and ctx_mark.line != mark.line:
            problem += f", {ctx} on line {ctx_mark.line + 1}"
        raise FrenzyInputError(f"{source}{where}", f"is not valid YAML ({problem})") from None
    except _DuplicateKey as e:
        raise FrenzyInputError(f"{source} line {e.line}",
                               f"key {e.key!r} is given twice (first on line {e.first})") from None
    except RecursionError:      # only the pure-Python loader; libyaml stops at depth 1000 itself
        raise FrenzyInputError(source, "nests too deeply") from None
    finally:
        loader.dispose()
    if kind is not None:
        check_kind(data, source, kind)
    return data


def read_text(path: str | Path, what: str = "YAML", max_bytes: int = MAX_BYTES) -> str:
    """The text of a user's file, with size (``max_bytes``) and encoding checked; errors name
    ``what``."""
    p = Path(path)
    if not p.exists():
        raise FrenzyInputError(what, f"file {str(p)!r} does not exist")
    if not p.is_file():
        raise FrenzyInputError(what, f"{str(p)!r} is not a regular file")
    try:
        with p.open("rb") as fh:
            raw = fh.read(max_bytes + 1)
    except OSError as e:
        raise FrenzyInputError(what, f"cannot read {str(p)!r}: {e.strerror}") from None
    if len(raw) > max_bytes:
        raise FrenzyInputError(str(p), f"is larger than {max_bytes // 2**20} MiB, the limit for a {what} file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise FrenzyInputError(f"{p} line {line}",
                               f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def load_yaml(path: str | Path, kind: FileKind | None = None, what: str | None = None) -> Any:
    """Read and parse a user's YAML file (``kind``: which kind of file it must be)."""
    text = read_text(path, what or (kind.name.removesuffix(" file") if kind else "YAML"))
    return parse_yaml(text, source=str(path), kind=kind)


def check_kind(data: Any, source: str, kind: FileKind) -> None:
    """``data`` must be a mapping with one of ``kind``'s keys; name the kind it is otherwise."""
    see = f"(see {kind.example})"
    if data is None:
        raise FrenzyInputError(source, f"is empty; a {kind.name} is a mapping with {', '.join(kind.keys)} {see}")
    if not isinstance(data, dict):
        raise FrenzyInputError(source, f"must be a mapping (a {kind.name} has {', '.join(kind.keys)}), "
                                       f"not a {type(data).__name__} {see}")
    if any(k in data for k in kind.keys):
        return
    for other in KINDS:
        if other is not kind and any(k in data for k in other.keys):
            raise FrenzyInputError(source, f"is a {other.name}, not a {kind.name} {see}")
    raise FrenzyInputError(source, f"is not a {kind.name}: it has none of {', '.join(kind.keys)} {see}")
