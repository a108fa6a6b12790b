#!/bin/sh
# written by `homepd advise export`; see README.md for where each value came from
set -e
MODEL_ID="${MODEL_ID:?set MODEL_ID to the model id vLLM loads (see README.md)}"
CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 vllm serve "$MODEL_ID" --port 8100 --max-num-seqs 4 --max-model-len 8192 --enable-chunked-prefill --max-num-batched-tokens 256 --long-prefill-token-threshold 256 --enable-prefix-caching --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}' &
CUDA_VISIBLE_DEVICES=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5601 vllm serve "$MODEL_ID" --port 8200 --max-num-seqs 4 --max-model-len 8192 --enable-chunked-prefill --max-num-batched-tokens 256 --long-prefill-token-threshold 256 --enable-prefix-caching --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}' &
# vLLM's proxy for the NixlConnector: tests/v1/kv_connector/nixl_integration/toy_proxy_server.py
python toy_proxy_server.py --port 8000 --prefiller-host 127.0.0.1 --prefiller-port 8100 --decoder-host 127.0.0.1 --decoder-port 8200
