#!/bin/sh
# written by `homepd advise export`; see README.md for where each value came from
set -e
MODEL="${MODEL:-smollm2-135m-instruct-q4_1}"  # the GGUF homepd served (a path: `homepd models` shows it)
llama-server -m "$MODEL" --host 0.0.0.0 --port 8080 -c 8192 -np 4 --kv-unified -b 32 -ub 32 -t 4 -tb 4 --cache-prompt --cache-reuse 256 --jinja
