"""Write every train setting's help, from TrainConfig's field metadata, into the sweep schema and docs/settings.md.

Each setting's help is written once, in its field (``roundalign.training.config.TrainConfig``,
``metadata["help"]``, and ``metadata["choices"]`` where it has a fixed set of values). This script rewrites from it:

- the two marked blocks of workflow/schemas/sweep.schema.yaml that list the train keys (the sweep's ``train:``, with
  defaults, and each model's ``train:``, without): each key's type, enum, description and default. Snakemake reads
  the schema as a plain file, so the text is written into it; the rest of the schema is left as it is;
- docs/settings.md, a table of every setting (key, type, default, help).

Both are written atomically (a temp file renamed over the old one). ``--check`` writes nothing and exits 1 naming
each key whose schema entry or table row differs from the metadata (tests/test_settings.py runs it).

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
from roundalign.settings import settings_of
from roundalign.training.config import (TrainConfig, setting_choices, setting_default, setting_help,
                                        setting_type, show_value)
from roundalign.training.sweep import _PER_RUN_KEYS

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow/schemas/sweep.schema.yaml"
DOCS = ROOT / "docs/settings.md"
WIDTH = 100  # where the schema's descriptions wrap, indentation included (a line may pass it by one word)
BEGIN = re.compile(r"^(?P<indent> *)# BEGIN train settings \((?P<mode>with|no) defaults\)")
END = re.compile(r"^ *# END train settings")
BEGIN_NOTE = "tools/docs_gen/settings.py writes them from TrainConfig"
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


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


def schema_entry(key: str, with_default: bool) -> dict:
    """The JSON-schema property of train key ``key``: type, description, enum, items and (``with_default``) default."""
    base, optional = _split_optional(setting_type(key))
    entry: dict = {}
    if typing.get_origin(base) is tuple:
        entry["type"] = "array"
    else:
        entry["type"] = [JSON_TYPES[base], "null"] if optional else JSON_TYPES[base]
    entry["description"] = setting_help(key)
    choices = setting_choices(key)
    if choices is not None:
        entry["enum"] = list(choices) + [None] * optional
    if typing.get_origin(base) is tuple:
        entry["items"] = {"type": JSON_TYPES[typing.get_args(base)[0]]}
    if with_default:
        entry["default"] = _json_default(setting_default(key))
    return entry


class _Dumper(yaml.SafeDumper):
    """Mappings in block style, lists (enum, type, default) on one line: ``enum: [eager, sdpa]``."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def schema_block(indent: str, with_default: bool) -> list[str]:
    """The YAML lines of every train key's schema property, indented by ``indent``."""
    text = yaml.dump({k: schema_entry(k, with_default) for k in keys()}, Dumper=_Dumper, sort_keys=False,
                     default_flow_style=False, width=WIDTH - len(indent), allow_unicode=True)
    return [indent + line if line else line for line in text.splitlines()]


def render_schema(text: str) -> str:
    """``text`` (the schema) with each marked train-settings block rewritten from the metadata."""
    lines, out, i = text.splitlines(), [], 0
    blocks = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if END.match(lines[j])), None)
        if end is None:
            raise SystemExit(f"{SCHEMA.name}: line {i + 1}: '# BEGIN train settings' without '# END train settings'")
        out.append(f"{m['indent']}# BEGIN train settings ({m['mode']} defaults): {BEGIN_NOTE}")
        out += schema_block(m["indent"], m["mode"] == "with")
        out.append(lines[end])
        blocks += 1
        i = end + 1
    if blocks == 0:
        raise SystemExit("no '# BEGIN train settings (with|no) defaults' block in the schema")
    return "\n".join(out) + "\n"


def _show(value) -> str:
    return "(required)" if value is dataclasses.MISSING else f"`{show_value(value)}`"


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


def _schema_props(schema: dict) -> dict[str, dict]:
    """The train-key properties of each place the schema lists them, by their dotted place."""
    model = schema["properties"]["models"]["additionalProperties"]["properties"]["train"]
    return {"train": schema["properties"]["train"].get("properties", {}),
            "models.<name>.train": model.get("properties", {})}


def check(schema_path: Path = SCHEMA, docs_path: Path = DOCS) -> list[str]:
    """Each way the schema's train keys or the docs table differ from the metadata, naming the key; [] if none."""
    problems = []
    text = schema_path.read_text()
    try:
        expected = render_schema(text)
    except SystemExit as exc:
        return [f"{schema_path}: {exc}"]
    if text != expected:
        places = {"train": True, "models.<name>.train": False}
        found = _schema_props(yaml.safe_load(text))
        for place, props in found.items():
            for key in keys():
                want = schema_entry(key, places[place])
                if key not in props:
                    problems.append(f"{schema_path}: {place}.{key} is missing")
                    continue
                for attr in sorted(set(want) | set(props[key])):
                    if props[key].get(attr) != want.get(attr):
                        problems.append(f"{schema_path}: {place}.{key}: {attr} differs from TrainConfig's "
                                        f"(schema {props[key].get(attr)!r}, TrainConfig {want.get(attr)!r})")
            for key in sorted(set(props) - set(keys())):
                problems.append(f"{schema_path}: {place}.{key} is no TrainConfig key")
        if not problems:
            problems.append(f"{schema_path}: the train-settings blocks are not as the script writes them")
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
