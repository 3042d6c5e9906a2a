"""The configuration reference, docs/config.md, generated from the schema and from the validation that runs.

    python -m skyrl_mtp.config.reference --write     # or without --write: print it

Each column has one source, so the reference cannot drift from the code (tests/unit/config/
test_config_reference.py fails when docs/config.md is not what this module makes):
- key, type and default: the dataclasses of config/schema.py (defaults read off an instance of
  `SkyRLConfig`, so a nested default such as the head optimizer's own LR shows as it is);
- meaning: the comments of schema.py at each field (the comment lines right above it and the comment
  on its line); a section's intro is its dataclass's docstring;
- allowed: the rules config/validation.py applies, recorded by its `Checker` while it runs every check
  on the default config, in the words of the error a bad value gets.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from skyrl_mtp.config import schema
from skyrl_mtp.config.checker import Checker
from skyrl_mtp.config.validation import run_checks

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m skyrl_mtp.config.reference --write"


@dataclass(frozen=True)
class Key:
    path: str          # dotted, e.g. trainer.mtp.loss_type
    type: str          # the annotation as written in schema.py
    default: Any
    meaning: str       # from the comments at the field; "" when it has none
    allowed: tuple[str, ...]


@dataclass(frozen=True)
class Section:
    path: str          # dotted path of the dataclass, "" for the root
    intro: str         # the dataclass's docstring
    keys: tuple[Key, ...]
    allowed: tuple[str, ...] = ()   # rules validation applies to the section's keys together


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment text at that field of `source`, joined into one line."""
    lines = source.splitlines()
    trailing: dict[int, str] = {}    # row -> a comment that follows code on that row
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][:tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string
    out: dict[tuple[str, str], str] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            row = stmt.lineno - 1                      # 1-based row of the line above the field
            while row >= 1 and lines[row - 1].strip().startswith("#"):
                above.insert(0, lines[row - 1].strip())
                row -= 1
            after = [trailing[r] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in trailing]
            text = " ".join(c.lstrip("#").strip() for c in above + after)
            out[(cls.name, stmt.target.id)] = re.sub(r"\s+", " ", text).strip()
    return out


def validation_rules() -> dict[str, list[str]]:
    """Key -> what validation allows, as its checks record it when run on the default config."""
    checker = Checker(OmegaConf.structured(schema.SkyRLConfig))
    run_checks(checker)
    return checker.rules


def schema_sources() -> list[Path]:
    """The files that define the schema's dataclasses (schema.py and the parts split off it)."""
    seen: set[type] = set()

    def walk(obj: Any) -> None:
        seen.add(type(obj))
        for f in fields(obj):
            if is_dataclass(getattr(obj, f.name)):
                walk(getattr(obj, f.name))

    walk(schema.SkyRLConfig())
    return sorted({Path(sys.modules[cls.__module__].__file__) for cls in seen})


def sections() -> list[Section]:
    comments = {k: v for source in schema_sources() for k, v in field_comments(source.read_text()).items()}
    rules = validation_rules()
    out: list[Section] = []

    def walk(obj: Any, path: str) -> None:
        keys, nested = [], []
        for f in fields(obj):
            value, dotted = getattr(obj, f.name), f"{path}.{f.name}" if path else f.name
            if is_dataclass(value):
                nested.append((value, dotted))
            else:
                keys.append(Key(dotted, str(f.type), value, comments.get((type(obj).__name__, f.name), ""),
                                tuple(rules.get(dotted, ()))))
        if keys:
            out.append(Section(path, _docstring(type(obj)), tuple(keys), tuple(rules.get(path, ()))))
        for value, dotted in nested:
            walk(value, dotted)

    walk(schema.SkyRLConfig(), "")
    return out


def _docstring(cls: type) -> str:
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else re.sub(r"\s+", " ", doc).strip()   # not dataclass's own


def all_keys() -> list[Key]:
    return [k for s in sections() for k in s.keys]


def _cell(text: str) -> str:
    """Markdown-safe table cell: pipes escaped everywhere, `*` and `<` outside code spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):            # even parts lie outside code spans
        parts[i] = parts[i].replace("*", r"\*").replace("<", "&lt;")
    return "`".join(parts).replace("|", r"\|")


def _code(text: str) -> str:
    """A table cell's code span."""
    return "`" + text.replace("|", r"\|") + "`"


def render() -> str:
    secs = sections()
    out = [
        "# Configuration reference",
        "",
        "Every key of a run's config, generated by `" + COMMAND + "` from the schema",
        "(`skyrl_mtp/config/schema.py`: keys, types, defaults and their meaning) and from the checks of",
        "`skyrl_mtp/config/validation.py` (the *Allowed* column is what those checks accept, in the words of",
        "the error a bad value gets: `key=value is invalid: <allowed>`). Do not edit it by hand;",
        "`tests/unit/config/test_config_reference.py` fails when it is stale.",
        "",
        "- Set a key on the command line as `key=value` (Hydra's override grammar), e.g.",
        "  `skyrl-mtp recipe=tiny_dapo trainer.mtp.num_speculative_tokens=auto`; a recipe (`recipes/*.yaml`) sets",
        "  its own values on top of these defaults.",
        "- An unknown key or a value of the wrong type is refused when the config is composed; the rules below",
        "  are checked next, all at once, before anything starts.",
        "- A rule that names another key's value shows it at that key's default. *Allowed* is empty where any",
        "  value of the key's type is accepted.",
        "- A key that does nothing with another key's value (e.g. `trainer.mtp.max_speculative_tokens` or",
        "  `explore_budget` with a fixed `num_speculative_tokens`) is refused when set, never silently ignored.",
        "- `trainer.placement.policy_num_workers` restates `megatron.tp * pp * cp * dp` (one worker per Megatron",
        "  rank): change them together.",
        "- The checkpoint (`model.path`) is checked from its files: its architecture, MTP layers when drafting,",
        "  weights, tokenizer files and chat template; data files from their first row (docs/data.md).",
        "",
    ]
    for sec in secs:
        title = f"`{sec.path}`" if sec.path else "top level"
        out += [f"## {title}", ""]
        if sec.intro:
            out += [sec.intro, ""]
        out += [f"Checked together: {_cell(a)}" for a in sec.allowed] + ([""] if sec.allowed else [])
        out += ["| Key | Type | Default | Allowed | Meaning |", "|---|---|---|---|---|"]
        for k in sec.keys:
            allowed = "<br>".join(_cell(a) for a in k.allowed)
            out.append(f"| {_code(k.path)} | {_code(k.type)} | {_code(json.dumps(k.default))} | {allowed} | "
                       f"{_cell(k.meaning)} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH} instead of printing it")
    args = parser.parse_args(argv)
    missing = [k.path for k in all_keys() if not k.meaning]
    if missing:
        print(f"keys without a comment in skyrl_mtp/config/schema.py: {missing}", file=sys.stderr)
        return 1
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
