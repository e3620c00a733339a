module github.com/context-engine/context-engine/clients/go

go 1.19

// grpc-go, protobuf-go and golang/protobuf are pinned at Debian bookworm's packaged
// versions, the ones check.sh vets and builds against (README.md). genproto is not: Debian
// ships a 2020-04-13 snapshot (0.0~git20200413.b5235f6, v0.0.0-20200413115906-b5235f65be36),
// older than the genproto grpc-go 1.33.3 itself requires, so module mode cannot select it;
// the pin below is that requirement. Newer releases work as well.
require (
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)

require github.com/golang/protobuf v1.5.2 // indirect
