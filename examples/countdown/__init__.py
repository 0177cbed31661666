"""Countdown: reach a target from a few numbers with `+ - * /`, each number used exactly once.

The example's pieces, one module each: `tasks` (reachable problems, disjoint train/eval splits,
the `"3 7 12 -> 33"` prompt), `reward` (safe exact scoring of an answer like `3*7+12`),
`workflow` (`CountdownWorkflow`), `tool_agent` (`CountdownToolAgent`, which may check a candidate
with a calculator tool before answering), `expressions` (random valid expressions), `warmstart`
(supervised format-only data for a tiny model) and `baselines` (target-blind hit rates;
`python -m examples.countdown.baselines`, not imported here).
"""

from examples.countdown.expressions import random_expression
from examples.countdown.reward import MAX_ANSWER_CHARS, countdown_reward, parse_expression
from examples.countdown.tasks import make_tasks, prompt, split_of
from examples.countdown.tool_agent import CountdownToolAgent
from examples.countdown.warmstart import tool_warmstart_examples, warmstart_examples, write_jsonl
from examples.countdown.workflow import CountdownWorkflow

__all__ = [
    "MAX_ANSWER_CHARS",
    "CountdownToolAgent",
    "CountdownWorkflow",
    "countdown_reward",
    "make_tasks",
    "parse_expression",
    "prompt",
    "random_expression",
    "split_of",
    "tool_warmstart_examples",
    "warmstart_examples",
    "write_jsonl",
]
