#!/bin/sh
# Vet the Go client, run the example worker's tests and build it without the Go module
# proxy: GOPATH mode over the Go libraries Debian packages (/usr/share/gocode; `make
# install` installs them).
# With the proxy reachable, plain module mode works too: `go mod tidy && go vet ./...`.
# Usage: check.sh [OUTPUT_BINARY]   (default: a temporary file, removed afterwards)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
gopath=$(mktemp -d)
trap 'rm -rf "$gopath"' EXIT
# The build runs from inside $gopath: a relative OUTPUT_BINARY is the caller's, so anchor it
# to the caller's directory now.
out=${1:-$gopath/worker}
case $out in /*) ;; *) out=$PWD/$out ;; esac
mkdir -p "$gopath/src/github.com/context-engine/context-engine/clients"
ln -s "$here" "$gopath/src/github.com/context-engine/context-engine/clients/go"
cd "$gopath/src/github.com/context-engine/context-engine/clients/go"
unformatted=$(gofmt -l contextenginev1 examples)
if [ -n "$unformatted" ]; then
  echo "gofmt would change: $unformatted" >&2
  exit 1
fi
export GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOFLAGS=
go vet ./...
go test ./examples/worker
go build -o "$out" ./examples/worker
echo "go vet, test and build: ok"
