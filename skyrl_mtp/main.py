"""Command-line entry point: `skyrl-mtp recipe=NAME key=value ... [--cfg job|plan]`.

Composes and validates the config before anything expensive starts, then hands it to the
trainer launcher. `--cfg job` prints the resolved config and exits; `--cfg plan` prints the GPU memory plan
(config/memory_plan.py) and exits, 2 when it does not fit; `--help` lists recipes.
"""

from __future__ import annotations

import sys

from skyrl_mtp.config import ConfigError, load_config, to_yaml
from skyrl_mtp.config.loader import _split_overrides, available_recipes, recipe_dirs
from skyrl_mtp.errors import problem

USAGE = """usage: skyrl-mtp [recipe=NAME] [recipe_dir=DIR] [key=value ...] [--cfg job|plan]

  recipe=NAME      a recipe from recipes/ (or recipe_dir=DIR, or $SKYRL_MTP_RECIPE_DIR)
  key=value        Hydra overrides, e.g. trainer.mtp.num_speculative_tokens=3 trainer.total_steps=20
  --cfg job        print the resolved config and exit
  --cfg plan       print the GPU memory plan per GPU and exit (exit code 2 if it does not fit)
  --help           this text and the available recipes
"""


SHOW = ("job", "all", "plan")


def parse_args(argv: list[str]) -> tuple[list[str], str | None, bool]:
    overrides: list[str] = []
    show: str | None = None
    want_help = False
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            want_help = True
        elif arg in ("--cfg", "-c"):
            show = next(it, None)
            if show not in SHOW:
                raise ConfigError([f"--cfg={show!r} is invalid: must be one of {list(SHOW)}"])
        elif arg.startswith("--cfg="):
            show = arg.split("=", 1)[1]
            if show not in SHOW:
                raise ConfigError([f"--cfg={show!r} is invalid: must be one of {list(SHOW)}"])
        elif arg.startswith("-"):
            raise ConfigError([f"{arg}: unknown option; allowed: --cfg job, --cfg plan, --help"])
        else:
            overrides.append(arg)
    return overrides, show, want_help


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        overrides, show, want_help = parse_args(argv)
        if want_help:
            cli, _ = _split_overrides(overrides)
            names = sorted(available_recipes(recipe_dirs(cli.get("recipe_dir"))))
            print(USAGE + "\nrecipes: " + ", ".join(names))
            return 0
        if show == "plan":
            return print_plan(overrides)
        cfg = load_config(overrides)
    except ConfigError as err:
        print(f"skyrl-mtp: {err}", file=sys.stderr)
        return 2
    if show is not None:
        print(to_yaml(cfg), end="")
        return 0
    from skyrl_mtp.trainer.launch import run

    return run(cfg)


def print_plan(overrides: list[str]) -> int:
    """`--cfg plan`: the memory plan of a config valid in every other respect, printed whether it fits or not."""
    from skyrl_mtp.config import compose_config, validate_config
    from skyrl_mtp.config.memory_plan import run_memory_plan

    cfg = compose_config(overrides)
    validate_config(cfg, check_memory=False)
    plan = run_memory_plan(cfg)
    if plan is None:
        raise ConfigError([problem("model.path", cfg.model.path, "no memory plan could be made from its config.json "
                                   "(validation checked the architecture; the plan reads the model's sizes)")])
    print(plan.describe())
    return 2 if plan.problems else 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
