"""Supervised fine-tuning against a loraplex server with nothing but the official `tinker` SDK.

Start a server (`loraplex serve`), then:

    TINKER_API_KEY=tml-local python examples/sft.py --base-url http://127.0.0.1:8000 --steps 20

It teaches a LoRA adapter one token sequence, prints loss:sum per step, saves the full state and
resumes from it into a second run, exactly as tinker-cookbook's loops do.
"""

from __future__ import annotations

import argparse

import numpy as np
import tinker
from tinker import types


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    args = parser.parse_args()

    rest = tinker.RestClient(base_url=args.base_url)
    base_model = rest.get_server_capabilities().result().supported_models[0].model_name
    # As a context manager the client ends its session (sessions/{id}/finish) on exit.
    with tinker.ServiceClient(base_url=args.base_url) as service:
        train(service, base_model, args)


def train(service: tinker.ServiceClient, base_model: str, args: argparse.Namespace) -> None:
    """SFT steps, a full save, and a resume from it."""
    run = service.create_lora_training_client(base_model=base_model, rank=args.rank, seed=0).result()

    # One sequence; position t predicts token t+1, every position weighted 1.
    tokens = [3, 17, 9, 41, 5, 22, 8, 30, 12, 7]
    weights = np.ones(len(tokens) - 1, np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": weights},
    )
    for step in range(args.steps):
        # Submit both before waiting: the server queues them in order, the client waits once.
        fb = run.forward_backward([datum], "cross_entropy")
        opt = run.optim_step(types.AdamParams(learning_rate=args.learning_rate))
        print(f"step {step:3d}  loss:sum {fb.result().metrics['loss:sum']:.4f}")
        opt.result()

    path = run.save_state("final").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    loss = resumed.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    print(f"saved {path}; resumed as {resumed.model_id} with loss:sum {loss:.4f}")


if __name__ == "__main__":
    main()
