"""Write the settings tree's settings (roundalign.settings) into the sweep schema and docs/settings.md.

Each setting is defined once, in the settings tree: TrainConfig's fields name its train settings, and the sweep's
``probe:`` and ``attribution:`` keys are its settings of section sweep (``sweep_settings``). This script rewrites
from it:

- the marked blocks of workflow/schemas/sweep.schema.yaml:
  ``# BEGIN train settings (with defaults)`` / ``(no defaults)`` ... ``# END train settings`` list the train keys
  (the sweep's ``train:``, with defaults, and each model's ``train:``, without): each key's type, enum, description
  and default; ``# BEGIN probe settings`` ... ``# END probe settings`` and ``# BEGIN attribution settings`` ...
  ``# END attribution settings`` list the keys of the sweep's ``probe:`` and ``attribution:``: each key's type,
  enum, items, bounds, description and default. Snakemake reads the schema as a plain file, so the text is written
  into it; the rest of the schema (each section's own description, default and additionalProperties) is left as
  it is;
- docs/settings.md: a table of every train setting (key, type, default, help), of the settings of
  ``roundalign probe`` and ``attribute``, and of the sweep's ``probe:`` and ``attribution:`` keys.

Both are written atomically (a temp file renamed over the old one). ``--check`` writes nothing and exits 1 naming
each key whose schema entry or table row differs from the tree (tests/test_settings.py runs it).

    python -m tools.docs_gen.settings            # rewrite both
    python -m tools.docs_gen.settings --check    # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import typing
from pathlib import Path

import yaml

from roundalign.probes.attribute import AttributeConfig
from roundalign.probes.probe import ProbeConfig
from roundalign.settings import Setting, setting, settings_of, sweep_settings
from roundalign.training.config import (TrainConfig, setting_choices, setting_default, setting_help,
                                        setting_type, show_value)
from roundalign.training.sweep import _PER_RUN_KEYS

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow/schemas/sweep.schema.yaml"
DOCS = ROOT / "docs/settings.md"
WIDTH = 100  # where the schema's descriptions wrap, indentation included (a line may pass it by one word)
PARTS = ("probe", "attribution")  # the sweep's sections whose keys are the tree's settings of section sweep
BEGIN = re.compile(r"^(?P<indent> *)# BEGIN (?P<part>train|probe|attribution) settings"
                   r"(?: \((?P<mode>with|no) defaults\))?")
END = re.compile(r"^ *# END (?P<part>\w+) settings")
BEGIN_NOTE = "tools/docs_gen/settings.py writes them from TrainConfig"
SWEEP_NOTE = "tools/docs_gen/settings.py writes them from the settings tree's sweep section"
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
BOUNDS = (("at_least", "minimum"), ("above", "exclusiveMinimum"), ("at_most", "maximum"), ("below", "exclusiveMaximum"))


def keys(per_run: bool = False) -> list[str]:
    """TrainConfig's keys in field order; without the per-run keys (model, variant, seed) unless ``per_run``."""
    return [f.name for f in dataclasses.fields(TrainConfig) if per_run or f.name not in _PER_RUN_KEYS]


def _split_optional(hint):
    args = typing.get_args(hint)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _json_default(value):
    return list(value) if isinstance(value, tuple) else value


def _property(s: Setting, help_: str, choices: tuple | None, default, constrained: bool) -> dict:
    """The JSON-schema property of setting ``s``: type, description, enum, items, and, where ``constrained``, the
    items' choices, minItems and bounds; ``default`` unless it is ``dataclasses.MISSING``."""
    base, optional = _split_optional(s.type)
    listed = typing.get_origin(base) is tuple
    name = "array" if listed else JSON_TYPES[base]
    entry: dict = {"type": [name, "null"] if optional else name, "description": help_}
    if choices is not None:
        entry["enum"] = list(choices) + [None] * optional
    if listed:
        entry["items"] = {"type": JSON_TYPES[typing.get_args(base)[0]]}
        if constrained and s.item_choices is not None:
            entry["items"]["enum"] = list(s.item_choices)
        if constrained and s.min_items is not None:
            entry["minItems"] = s.min_items
    if constrained:
        entry.update({word: getattr(s, attr) for attr, word in BOUNDS if getattr(s, attr) is not None})
    if default is not dataclasses.MISSING:
        entry["default"] = _json_default(default)
    return entry


def schema_entry(key: str, with_default: bool) -> dict:
    """The JSON-schema property of train key ``key``: type, description, enum, items and (``with_default``) default.
    Its bounds are not in the schema: TrainConfig checks them when the sweep is built."""
    return _property(setting(key), setting_help(key), setting_choices(key),
                     setting_default(key) if with_default else dataclasses.MISSING, constrained=False)


def sweep_entry(key: str) -> dict:
    """The JSON-schema property of sweep key ``key`` (``probe.engines``): type, description, enum, items, minItems,
    bounds and default, all from its setting (the schema is the only check of these keys)."""
    s = setting(key)
    return _property(s, s.help, s.valid(), s.default, constrained=True)


def sweep_entries(part: str) -> dict[str, dict]:
    """The JSON-schema properties of the sweep's ``part:`` (probe or attribution), by their key there."""
    return {s.key.partition(".")[2]: sweep_entry(s.key) for s in sweep_settings(part)}


class _Dumper(yaml.SafeDumper):
    """Mappings in block style, lists (enum, type, default) on one line: ``enum: [eager, sdpa]``."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def schema_block(indent: str, entries: dict[str, dict]) -> list[str]:
    """The YAML lines of the schema properties ``entries``, indented by ``indent``."""
    text = yaml.dump(entries, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=WIDTH - len(indent),
                     allow_unicode=True)
    return [indent + line if line else line for line in text.splitlines()]


def _block(m: re.Match) -> list[str]:
    """The marker and properties of the block that ``m`` (a BEGIN line) opens."""
    indent, part, mode = m["indent"], m["part"], m["mode"]
    if part == "train":
        if mode is None:
            raise SystemExit("'# BEGIN train settings' names no '(with defaults)' or '(no defaults)'")
        return [f"{indent}# BEGIN train settings ({mode} defaults): {BEGIN_NOTE}",
                *schema_block(indent, {k: schema_entry(k, mode == "with") for k in keys()})]
    if mode is not None:
        raise SystemExit(f"'# BEGIN {part} settings' takes no '({mode} defaults)': its keys always have theirs")
    return [f"{indent}# BEGIN {part} settings: {SWEEP_NOTE}", *schema_block(indent, sweep_entries(part))]


def render_schema(text: str) -> str:
    """``text`` (the schema) with each marked block (train, probe and attribution settings) rewritten from the
    tree."""
    lines, out, i = text.splitlines(), [], 0
    seen = set()
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if END.match(lines[j])), None)
        if end is None or END.match(lines[end])["part"] != m["part"]:
            raise SystemExit(f"{SCHEMA.name}: line {i + 1}: '# BEGIN {m['part']} settings' without "
                             f"'# END {m['part']} settings' before the next block's end")
        out += _block(m)
        out.append(lines[end])
        seen.add(m["part"])
        i = end + 1
    for part in ("train", *PARTS):
        if part not in seen:
            raise SystemExit(f"no '# BEGIN {part} settings' block in the schema")
    return "\n".join(out) + "\n"


def _show(value) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    return '`""`' if value == "" else f"`{show_value(value)}`"


def _type_name(key: str) -> str:
    base, optional = _split_optional(setting_type(key))
    name = f"list of {typing.get_args(base)[0].__name__}" if typing.get_origin(base) is tuple else base.__name__
    return f"{name} or null" if optional else name


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_docs() -> str:
    """docs/settings.md: every train setting's key, type, default and help."""
    rows = [f"| `{k}` | {_type_name(k)} | {_show(setting_default(k))} | {_cell(setting_help(k))} |"
            for k in keys(per_run=True)]
    return "\n".join([
        "# Train settings",
        "",
        "<!-- Written by tools/docs_gen/settings.py from the settings tree (roundalign.settings): "
        "edit the help there and rerun the script (tests/test_settings.py checks this file). -->",
        "",
        "Every key of a `roundalign train --config` YAML file and of `--set KEY=VALUE`, and, except `model`, "
        "`variant` and `seed` (which a sweep sets per run), of a sweep's `train:` and `models.<name>.train:` "
        "(workflow/schemas/sweep.schema.yaml). `roundalign train --help` shows the same help.",
        "",
        "| key | type | default | help |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
        *command_table("probe", ProbeConfig, "roundalign probe"),
        *command_table("attribute", AttributeConfig, "roundalign attribute"),
        *sweep_table("probe", "one probe job per model and engine", "roundalign probe"),
        *sweep_table("attribution", "one attribution job per model and engine", "roundalign attribute"),
    ])


def command_table(name: str, cls, command: str) -> list[str]:
    """The settings of a command that are fields of ``cls``: flag, the tree's key, type, the command's default,
    help (the tree's, the same text ``train`` shows for a shared key)."""
    rows = []
    for f, s in settings_of(cls):
        flag = "--" + (f.metadata.get("flag") or f.name.replace("_", "-"))
        narrowed = f.metadata.get("choices")
        text = s.help + (f" This command takes {', '.join(narrowed)}." if narrowed else "")
        rows.append(f"| `{flag}` | `{s.key}` | {_type_name(s.key)} | {_show(f.default)} | {_cell(text)} |")
    return [f"## {command}", "",
            f"The flags of `{command}` that are settings of the tree (roundalign.settings); `{command} --help` shows "
            "the same help. A key shared with train has train's help and this command's default.", "",
            "| flag | setting | type | default | help |", "| --- | --- | --- | --- | --- |", *rows, ""]


def sweep_table(part: str, jobs: str, command: str) -> list[str]:
    """The keys of the sweep's ``part:``: key, the setting it passes to ``command`` (none: the sweep's own), type,
    the sweep's default, help (the setting's, then the sweep's own choices, note and what null means)."""
    rows = [f"| `{s.key}` | {f'`{s.feeds}`' if s.feeds else '(sweep)'} | {_type_name(s.key)} | {_show(s.default)} | "
            f"{_cell(s.help)} |" for s in sweep_settings(part)]
    return [f"## Sweep `{part}:`", "",
            f"The keys of a sweep config's `{part}:` ({jobs}; workflow/schemas/sweep.schema.yaml, whose descriptions "
            f"are this help). A key that names a setting passes it to `{command}` and shows that setting's help; a "
            "key without one is the sweep's own.", "",
            "| key | setting | type | default | help |", "| --- | --- | --- | --- | --- |", *rows, ""]


def _schema_props(schema: dict) -> dict[str, dict]:
    """The train-key properties of each place the schema lists them, by their dotted place."""
    model = schema["properties"]["models"]["additionalProperties"]["properties"]["train"]
    return {"train": schema["properties"]["train"].get("properties", {}),
            "models.<name>.train": model.get("properties", {})}


def _compare(where: str, place: str, props: dict, want: dict[str, dict], source: str) -> list[str]:
    """Each way the schema properties ``props`` at ``place`` differ from ``want`` (``source``'s), naming the key."""
    problems = []
    for key, entry in want.items():
        if key not in props:
            problems.append(f"{where}: {place}.{key} is missing")
            continue
        for attr in sorted(set(entry) | set(props[key])):
            if props[key].get(attr) != entry.get(attr):
                problems.append(f"{where}: {place}.{key}: {attr} differs from {source}'s "
                                f"(schema {props[key].get(attr)!r}, {source} {entry.get(attr)!r})")
    for key in sorted(set(props) - set(want)):
        problems.append(f"{where}: {place}.{key} is not in {source}")
    return problems


def check(schema_path: Path = SCHEMA, docs_path: Path = DOCS) -> list[str]:
    """Each way the schema's train, probe or attribution keys or the docs tables differ from the tree, naming the
    key; [] if none."""
    problems = []
    text = schema_path.read_text()
    try:
        expected = render_schema(text)
    except SystemExit as exc:
        return [f"{schema_path}: {exc}"]
    if text != expected:
        schema = yaml.safe_load(text)
        places = {"train": True, "models.<name>.train": False}
        for place, props in _schema_props(schema).items():
            want = {key: schema_entry(key, places[place]) for key in keys()}
            problems += _compare(str(schema_path), place, props, want, "TrainConfig")
        for part in PARTS:
            props = schema["properties"].get(part, {}).get("properties", {})
            problems += _compare(str(schema_path), part, props, sweep_entries(part), "the settings tree")
        if not problems:
            problems.append(f"{schema_path}: the settings blocks are not as the script writes them")
    docs = docs_path.read_text() if docs_path.is_file() else ""
    want_docs = render_docs()
    if docs != want_docs:
        have = {line.split("|")[1].strip(): line for line in docs.splitlines() if line.startswith("| `")}
        rows = {line.split("|")[1].strip(): line for line in want_docs.splitlines() if line.startswith("| `")}
        stale = [k.strip("`") for k in rows if have.get(k) != rows[k]] + \
                [k.strip("`") for k in have if k not in rows]
        problems.append(f"{docs_path}: differs from TrainConfig's help"
                        + (f" (keys: {', '.join(stale)})" if stale else " (outside the table)"))
    return problems


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale key")
    ap.add_argument("--schema", type=Path, default=SCHEMA, help="sweep schema (default %(default)s)")
    ap.add_argument("--docs", type=Path, default=DOCS, help="settings table (default %(default)s)")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.schema, args.docs)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("rerun: python -m tools.docs_gen.settings", file=sys.stderr)
        return 1 if problems else 0
    text = args.schema.read_text()
    for path, new, old in ((args.schema, render_schema(text), text),
                           (args.docs, render_docs(), args.docs.read_text() if args.docs.is_file() else None)):
        if new != old:
            write_atomic(path, new)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
