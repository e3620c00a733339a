package main

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// deadlines records the deadline of each call it answers, failing the first `failing` of
// them with DEADLINE_EXCEEDED, and, as grpc-go does, any whose deadline has passed.
type deadlines struct {
	failing int
	seen    []time.Duration // 0: the call had no deadline
}

func (d *deadlines) rpc(ctx context.Context, _ string, _ ...grpc.CallOption) (string, error) {
	var left time.Duration
	if at, ok := ctx.Deadline(); ok {
		left = time.Until(at)
		if left <= 0 {
			left = -1 // a deadline already past
		}
	}
	d.seen = append(d.seen, left)
	if len(d.seen) <= d.failing || left < 0 {
		return "", status.Error(codes.DeadlineExceeded, "too slow")
	}
	return "ok", nil
}

// A -timeout of 0 is no deadline, as in the Python and TypeScript clients: it was a
// deadline already past, and every RPC failed DEADLINE_EXCEEDED without being sent.
func TestATimeoutOfZeroIsNoDeadline(t *testing.T) {
	d := &deadlines{}
	if _, err := call(context.Background(), 0, d.rpc, "request"); err != nil {
		t.Fatalf("call with no deadline: %v", err)
	}
	if len(d.seen) != 1 || d.seen[0] != 0 {
		t.Fatalf("deadline sent: %v, want none", d.seen)
	}
	// send resends after DEADLINE_EXCEEDED with twice the deadline: twice none is none.
	d = &deadlines{failing: 1}
	if _, err := send(context.Background(), 0, d.rpc, "request"); err != nil {
		t.Fatalf("send with no deadline: %v", err)
	}
	if len(d.seen) != 2 || d.seen[0] != 0 || d.seen[1] != 0 {
		t.Fatalf("deadlines sent: %v, want none twice", d.seen)
	}
	// A deadline still doubles.
	d = &deadlines{failing: 1}
	if _, err := send(context.Background(), time.Minute, d.rpc, "request"); err != nil {
		t.Fatalf("send: %v", err)
	}
	if len(d.seen) != 2 || d.seen[0] > time.Minute || d.seen[1] <= time.Minute {
		t.Fatalf("deadlines sent: %v, want one minute, then two", d.seen)
	}
}

func TestANegativeTimeoutIsRefusedAsTheFlagsAreParsed(t *testing.T) {
	var d deadlineFlag
	for _, value := range []string{"-1s", "-1ns"} {
		if err := d.Set(value); err == nil {
			t.Errorf("-timeout %s was taken", value)
		}
	}
	if err := d.Set("0"); err != nil || d != 0 {
		t.Errorf("-timeout 0: %v, %v", err, time.Duration(d))
	}
	if err := d.Set("45s"); err != nil || time.Duration(d) != 45*time.Second {
		t.Errorf("-timeout 45s: %v, %v", err, time.Duration(d))
	}
}
