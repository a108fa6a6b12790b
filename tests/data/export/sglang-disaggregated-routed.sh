#!/bin/sh
# written by `homepd advise export`; see README.md for where each value came from
set -e
MODEL_ID="${MODEL_ID:?set MODEL_ID to the model id SGLang loads (see README.md)}"
python -m sglang.launch_server --model-path "$MODEL_ID" --port 30000 --max-running-requests 4 --context-length 8192 --chunked-prefill-size 256 --disaggregation-mode prefill --disaggregation-transfer-backend nixl --disaggregation-bootstrap-port 8998 --base-gpu-id 0 &
python -m sglang.launch_server --model-path "$MODEL_ID" --port 30001 --max-running-requests 4 --context-length 8192 --chunked-prefill-size 256 --disaggregation-mode decode --disaggregation-transfer-backend nixl --base-gpu-id 1 &
python -m sglang_router.launch_router --pd-disaggregation --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001 --host 0.0.0.0 --port 8000
