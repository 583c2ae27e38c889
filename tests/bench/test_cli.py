"""`tokenmill bench` argument handling (no server needed)."""
from __future__ import annotations

import pytest

from tokenmill.bench.cli import _agentic_config
from tokenmill.cli import build_parser


def parse(*argv: str):
    argv = ["bench", *argv]
    return build_parser(argv).parse_args(argv)


def test_shape_flags_reach_the_workload_config() -> None:
    args = parse("--turns", "7", "--min-turns", "2", "--first-turn-tokens", "100", "--new-tokens", "9",
                 "--output-tokens", "5", "--shared-prompt-tokens", "0", "--tool-think-median", "0.3",
                 "--user-turn-prob", "0.5", "--thick-fraction", "0.2", "--thick-parallel", "4", "--seed", "11",
                 "--sessions", "9", "--concurrency", "1,3")
    cfg = _agentic_config(args)
    assert (cfg.turns_per_session, cfg.min_turns_per_session, cfg.first_turn_tokens, cfg.new_tokens_per_turn,
            cfg.output_tokens_per_turn, cfg.shared_prompt_tokens) == (7, 2, 100, 9, 5, 0)
    assert (cfg.tool_think_median_s, cfg.user_turn_probability, cfg.thick_session_fraction,
            cfg.thick_session_parallel, cfg.seed, cfg.num_sessions) == (0.3, 0.5, 0.2, 4, 11, 9)
    assert args.concurrency == (1, 3)


def test_production_shape_with_override() -> None:
    cfg = _agentic_config(parse("--production-shape", "--output-tokens", "100"))
    assert cfg.turns_per_session == 30 and cfg.first_turn_tokens == 10000 and cfg.output_tokens_per_turn == 100


def test_bad_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="min_turns_per_session"):
        _agentic_config(parse("--turns", "2", "--min-turns", "5"))
    with pytest.raises(SystemExit):
        parse("--concurrency", "a,b")
