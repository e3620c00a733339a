#!/bin/sh
# Regenerate the committed Go stubs (contextenginev1/) from proto/ with protoc,
# protoc-gen-go and protoc-gen-go-grpc. An argument writes them under another directory
# instead (the drift check in tests/e2e/test_go_client.py compares the two).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
module=github.com/context-engine/context-engine/clients/go
protoc -I "$here/../../proto" \
  --go_out="$out" --go_opt=module=$module \
  --go-grpc_out="$out" --go-grpc_opt=module=$module \
  context_engine/v1/context_engine.proto
