module github.com/context-engine/context-engine/clients/go

go 1.19

// The versions the stubs and example are vetted and built against (Debian bookworm's
// packaged Go libraries; see README.md). Newer releases work as well.
require (
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)

require github.com/golang/protobuf v1.5.2 // indirect
