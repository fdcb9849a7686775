"""The Airflow trigger form of a pipeline: one Param schema per knob the spec exposes (``params``).

Airflow validates a trigger against these schemas before any run exists; the
run then applies the values through the spec's own validation
(``trainyard.spec.with_params``). Every bound here is finite and small: the
schemas are built on every DAG parse.
"""

from __future__ import annotations

import math
from typing import Any

from trainyard.spec import MAX_NODES, PipelineSpec, positive_number

# Trigger-form sections (Airflow 3 groups Params by their schema's ``section``).
SECTION_NODES = "Nodes"
SECTION_TRAINING = "Training"
SECTION_CHECKPOINT = "Checkpoint"
# Bounds that catch typos (60 for 0.006, 3 for 0.003) rather than model choices; a spec's own larger
# value raises them (a default its own schema refused would make the DAG fail to import).
MAX_STEPS_BOUND = 10_000_000
MAX_LR = 1.0
# The same rule as ``trainyard.spec.valid_resume``, as a JSON-schema pattern: 'latest', 'none', or an absolute path without '..'.
RESUME_PATTERN = r"^(latest|none|/(?!(.*/)?\.\.(/|$)).*)$"


def param_schemas(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    """JSON schema (with default, title, description, section) of each exposed UI Param.

    ``description`` is Param's own argument; every other key is the Param's
    schema, which Airflow validates a trigger against before any run exists.
    Closed value sets are enums (a drop-down in the form); the rule that ties
    Params together (global batch divisible by micro-batch x nodes x ranks) is
    checked when the run opens, by ``with_params``, and fails the first task.
    """
    nodes, training = spec.nodes, spec.training
    # Bounded whatever the spec says (nodes.max is at most MAX_NODES, but count + spare may pass it): the
    # enum below is built on every parse.
    upper, batch, ranks = min(nodes.upper, MAX_NODES), training.global_batch, nodes.procs_per_node
    # When the other knob is a Param too, any value it could take keeps a choice open (its smallest: 1).
    least_micro = 1 if "micro_batch" in spec.params else training.micro_batch
    least_nodes = 1 if "nodes" in spec.params else nodes.count
    given_lr = training.arg("lr")
    lr = given_lr if positive_number(given_lr) else MAX_LR  # exposed only when it is one
    batch_rule = f"micro-batch x nodes x {ranks} rank(s) per node must divide the global batch ({batch})"
    schemas: dict[str, dict[str, Any]] = {
        "nodes": {
            "type": "integer",
            "minimum": 1,
            "maximum": upper,
            "default": nodes.count,
            "enum": [c for c in range(1, upper + 1) if batch % (least_micro * c * ranks) == 0],
            "title": "Nodes",
            "section": SECTION_NODES,
            "description": f"Nodes to train on, 1 to {upper}; the spec says {nodes.count}. Offered: the counts"
            f" that keep the rule {batch_rule}.",
        },
        "min_nodes": {
            "type": "integer",
            "minimum": 1,
            "maximum": upper,
            "default": nodes.min,
            "title": "Minimum nodes",
            "section": SECTION_NODES,
            "description": f"Fewest nodes a failure may scale the run down to; at most Nodes."
            f" The spec says {nodes.min}.",
        },
        "max_steps": {
            "type": "integer",
            "minimum": 1,
            "maximum": max(MAX_STEPS_BOUND, training.max_steps),
            "default": training.max_steps,
            "title": "Steps to train",
            "section": SECTION_TRAINING,
            "description": f"Optimizer steps this run trains, counted from the checkpoint it resumes from;"
            f" the spec says {training.max_steps}.",
        },
        "micro_batch": {
            "type": "integer",
            "minimum": 1,
            "maximum": batch,
            "default": training.micro_batch,
            "enum": [m for m in _divisors(batch) if batch % (m * least_nodes * ranks) == 0],
            "title": "Micro-batch",
            "section": SECTION_TRAINING,
            "description": f"Sequences per forward pass on one rank; the spec says {training.micro_batch}."
            f" Lower it to fit memory: the global batch stays, the rest is gradient accumulation."
            f" Rule: {batch_rule}.",
        },
        "lr": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": max(MAX_LR, lr),
            "default": lr,
            "title": "Learning rate",
            "section": SECTION_TRAINING,
            "description": f"Passed to the entrypoint as --lr (training.args.lr); the spec says {lr}.",
        },
        "resume_from": {
            "type": "string",
            "pattern": RESUME_PATTERN,
            "default": training.resume_from,
            # examples, not enum: the form offers the two keywords and still accepts a typed absolute path.
            "examples": list(dict.fromkeys(["latest", "none", training.resume_from])),
            "values_display": {"latest": "latest: the newest valid checkpoint", "none": "none: a fresh start"},
            "title": "Resume from",
            "section": SECTION_CHECKPOINT,
            "description": "'latest' valid checkpoint of this pipeline, 'none' for a fresh start, or the absolute"
            " path of a checkpoint folder (step_NNNNNN).",
        },
    }
    return {name: schemas[name] for name in spec.params}


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in ascending order, in O(sqrt n): DAG parsing must stay fast."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
