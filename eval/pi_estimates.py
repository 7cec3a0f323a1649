"""Estimated ms/token on a Raspberry Pi 4 and 5, from the bytes a decode step reads and the boards' memory bandwidth:
estimates, not measurements (this project has no Pi; the kernels' bits on the Pis' cores are tested under emulation,
tests/test_arm64_kernels.py, which says nothing of their speed).

    python -m halo.eval.pi_estimates [--out eval/results]

A decode step of a dense model reads every weight once (the embedding table only a row), so memory bandwidth bounds
it: ms/token >= bytes / bandwidth. Two figures per board: the floor at the published peak (32-bit LPDDR4-3200 on the
Pi 4, 32-bit LPDDR4X-4267 on the Pi 5), and the figure at the share of that peak distributed-llama's published Pi 4
number implies (Llama 2 7B in Q40 on one Pi 4B 8 GB: 1307.94 ms of inference a token, its README), taken to hold on
the Pi 5 as well. The bytes are what halo's single-process worker holds for the model (Transformer, --weights native).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

from halo.eval.report import command_line, host_line, run_script, write_report

# published peak bandwidth: bus width x transfer rate
BOARDS = {"Raspberry Pi 4 (Cortex-A72, LPDDR4-3200, 32-bit)": 3200e6 * 4,
          "Raspberry Pi 5 (Cortex-A76, LPDDR4X-4267, 32-bit)": 4267e6 * 4}
# distributed-llama's README: Llama 2 7B, Q40 weights, 1 x RasPi 4B 8 GB, inference 1307.94 ms a token; its weights
# read a token: 6.74e9 parameters less the 32000 x 4096 embedding, 18 bytes per 32 (Q40)
DLLAMA_PI4_BYTES = (6.738e9 - 32000 * 4096) * 18 / 32
DLLAMA_PI4_S = 1.30794
PI4_PEAK = BOARDS["Raspberry Pi 4 (Cortex-A72, LPDDR4-3200, 32-bit)"]
ACHIEVED = DLLAMA_PI4_BYTES / DLLAMA_PI4_S / PI4_PEAK  # the share of the peak a Pi 4 reached there


@dataclass
class Estimate:
    model: str
    bytes_per_token: float
    board: str
    floor_ms: float  # at the published peak
    estimate_ms: float  # at the share distributed-llama reached on a Pi 4


def model_bytes(name: str) -> float:
    from halo.compute.transformer import Transformer
    from halo.model.catalog import resolve_model
    from halo.model.loader import load_weights

    model = Transformer(load_weights(resolve_model(name)), "native", max_seq_len=16)
    return float(model.worker.nbytes)


def estimates(models: dict[str, float]) -> list[Estimate]:
    return [Estimate(model, size, board, 1e3 * size / peak, 1e3 * size / (ACHIEVED * peak))
            for model, size in models.items() for board, peak in BOARDS.items()]


def main(argv: list[str] | None = None) -> int:
    from halo.eval.bench_churn import q4_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="eval/results")
    args = parser.parse_args(argv)
    models = {"SmolLM2-135M-Instruct (Q4_1 GGUF)": model_bytes("smollm2-135m-instruct"),
              "TinyLlama-1.1B shape (Q4_0)": model_bytes(str(q4_checkpoint(22)))}
    rows = estimates(models)
    command = command_line("halo.eval.pi_estimates", argv)
    lines = ["# Raspberry Pi 4 / 5: estimated ms per token (estimates, not measurements)", "",
             f"Command: `{command}`. {host_line()} Bytes: what halo's worker holds for the model "
             "(every weight a decode step reads). Floor: bytes / published peak bandwidth. Estimate: at "
             f"{100 * ACHIEVED:.0f} % of the peak, the share distributed-llama's published Pi 4 figure implies "
             f"(Llama 2 7B Q40, {DLLAMA_PI4_BYTES / 1e9:.2f} GB a token in {1e3 * DLLAMA_PI4_S:.0f} ms: "
             f"{DLLAMA_PI4_BYTES / DLLAMA_PI4_S / 1e9:.2f} GB/s), assumed on the Pi 5 too.", "",
             "| model | MB a token | board | floor ms/token | estimate ms/token |", "|---|---|---|---|---|"]
    lines += [f"| {r.model} | {r.bytes_per_token / 1e6:.1f} | {r.board} | {r.floor_ms:.1f} | {r.estimate_ms:.0f} |"
              for r in rows]
    lines += ["", "distributed-llama's published Pi 4B figures for comparison (its README, Llama 2 7B Q40, Gigabit "
              "Ethernet): 1 Pi 1312.50 ms/token, 2 Pis 793.69, 4 Pis 494.00."]
    write_report(args.out, "pi_estimates", {"command": command, "host": host_line(), "achieved_share": ACHIEVED,
                                            "rows": [asdict(r) for r in rows]}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
