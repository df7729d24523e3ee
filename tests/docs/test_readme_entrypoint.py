"""The Databricks custom LLM serving recipe of docs/databricks.md stays true to the code: it logs the entrypoint
flavour with a GPU stack profile that exists, registers with the packed environment, and shows the command and
port the flavour writes. No engine, no network (the recipe needs a Databricks workspace to run)."""

from __future__ import annotations

import ast

from launch.gpu_profiles import select_profile
from model_code.entrypoint import COMMAND, DEFAULT_PORT, PORT_ENV
from tests.docs.readme_blocks import DOCS, marked_blocks

RECIPE_PAGE = DOCS / "databricks.md"  # holds the recipe and what it logs


def _calls(code: str, name: str) -> list[ast.Call]:
    tree = ast.parse("\n".join(line for line in code.splitlines() if not line.startswith("%")))  # notebook magics
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
    ]


def _keywords(call: ast.Call) -> dict[str, object]:
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if isinstance(k.value, ast.Constant)}


def test_the_recipe_logs_the_entrypoint_flavour_and_registers_with_env_pack() -> None:
    (block,) = marked_blocks("databricks-entrypoint")
    (logged,) = _calls(block.code, "log_model")
    given = _keywords(logged)
    assert given["flavor"] == "entrypoint"
    select_profile(given["profile"], python="3.11")  # a profile of the table (UnknownGpuProfile otherwise)
    (registered,) = _calls(block.code, "register_model")
    assert _keywords(registered)["env_pack"] == "databricks_model_serving"


def test_the_command_and_port_shown_are_the_ones_written() -> None:
    text = RECIPE_PAGE.read_text()
    assert f"`entrypoint: {COMMAND}`" in text
    assert f"`gateway.port: ${{{PORT_ENV}:-{DEFAULT_PORT}}}`" in text
