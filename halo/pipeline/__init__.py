"""Pipeline mode: contiguous layer ranges on stage workers (native CPU/GPU, browser WebGPU/WASM).

stage.py (a range of units and its KV cache, numpy) · torch_stage.py (the same on CUDA) ·
protocol.py (stage messages) · links.py (reaching a worker) · profile.py (measured worker profiles) ·
replan.py (planning and re-planning with scheduler/pipeline.py) · coordinator.py (`PipelineModel`:
the forward pass, recovery by recomputation) · onnx_export.py (a unit range as an ONNX graph) ·
browser.py (the worker page and its WebSocket) · connect.py (building a coordinator from the CLI's
options).
"""
