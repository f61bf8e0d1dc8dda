"""common.args.cli: --help grouped by section, the same flags and the same parsed Args as a flat tyro.cli."""
import sys

import pytest
import tyro

import dpo
import grpo
import ppo
from common.args import cli
from conftest import run_scripts

ARGV = {
    grpo: ["--lr", "0.5", "--group-size", "4", "--no-chat-template", "--fsdp.unit", "layer", "--vllm.sleep-level", "2",
           "--adam-betas", "0.8", "0.9", "--dataset-config", "main", "--overlong", "mask", "--exp-name", "x"],
    ppo: ["--max-grad-norm", "2", "--critic-model", "m", "--kl-target", "6", "--bootstrap-truncated", "--seed", "3"],
    dpo: ["--num-steps", "5", "--loss", "ipo", "--eval-split", "test", "--fsdp.keep-gathered", "on", "--no-ref-cache"],
}


@pytest.mark.parametrize("script", list(ARGV), ids=lambda m: m.__name__)
def test_same_args_as_flat_tyro(script, monkeypatch):
    for argv in ([], ARGV[script]):
        monkeypatch.setattr(sys, "argv", ["x", *argv])
        assert cli(script.Args) == tyro.cli(script.Args, args=argv)


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    """`python SCRIPT --help` of four scripts, each a process forked by conftest.run_scripts."""
    return run_scripts({s: [s, "--help"] for s in ("grpo.py", "ppo.py", "dpo.py", "rm.py")},
                       tmp_path_factory.mktemp("help"))


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py", "dpo.py", "rm.py"])
def test_help_is_grouped(helps, script):
    assert helps[script].returncode == 0, helps[script].stderr[-2000:]
    out = helps[script].stdout
    groups = [line.split("─")[1].strip() for line in out.splitlines() if line.startswith("╭─")]
    assert "run options" in groups and "fsdp options" in groups
    if script not in ("dpo.py", "rm.py"):
        assert groups[1:9] == ["run options", "model-and-data options", "reward options", "algorithm options",
                               "sampling options", "optimiser options", "batch-geometry options", "engine options"]
    for flag in ("--lr ", "--seed ", "--fsdp.unit"):  # flat names kept
        assert flag in out
