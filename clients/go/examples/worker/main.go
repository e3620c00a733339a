// Command worker is an example agent worker in Go: it opens a session, starts a run,
// builds a request, logs a tool call and its result, builds again (twice) and checks that
// the prefix hash held and that Build is pure. It also shows how to read the structured
// error details (ErrorInfo reason and metadata, BadRequest field) the engine sends, and
// how a write with an idempotency key is retried safely (a Rotate, resent as after a lost
// answer).
//
//	go run ./examples/worker -target 127.0.0.1:50051 -tenant example
//
// A real worker POSTs BuildResponse.ProviderPayload to the API named by ProviderApi and
// appends what the model said; the engine never calls a model itself.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	cev1 "github.com/context-engine/context-engine/clients/go/contextenginev1"
)

// EngineError is a failed RPC with the engine's structured details decoded.
type EngineError struct {
	Code     string
	Reason   string            // ErrorInfo.reason, e.g. "ORPHANED_TOOL_ITEM"
	Metadata map[string]string // ErrorInfo.metadata, e.g. {"current_epoch": "2"}
	Field    string            // first BadRequest field violation, e.g. "items[0].tool_result.call_id"
	Msg      string
}

func (e *EngineError) Error() string {
	return fmt.Sprintf("%s: %s [%s] field=%q", e.Code, e.Msg, e.Reason, e.Field)
}

// decode turns a gRPC error into an *EngineError (other errors pass through).
func decode(err error) error {
	st, ok := status.FromError(err)
	if !ok || err == nil {
		return err
	}
	out := &EngineError{Code: st.Code().String(), Msg: st.Message()}
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			out.Reason = d.GetReason()
			out.Metadata = d.GetMetadata()
		case *errdetails.BadRequest:
			if v := d.GetFieldViolations(); len(v) > 0 {
				out.Field = v[0].GetField()
			}
		}
	}
	return out
}

func spec() *cev1.PlanSpec {
	return &cev1.PlanSpec{
		ModelId: "claude-sonnet-4-5",
		Agent: &cev1.AgentSpec{
			AgentId: "trips", Version: "1", Instructions: "Plan train trips.",
		},
		Principal: &cev1.Principal{PrincipalId: "ada", Scopes: []string{"web.read"}, ScopeLabel: "owner"},
		Tools: []*cev1.ToolSpec{{
			Name:            "web.fetch",
			Description:     "Fetch a page.",
			InputSchemaJson: `{"type":"object","properties":{"url":{"type":"string"}},"required":["url"]}`,
			RequiredScopes:  []string{"web.read"},
			SideEffect:      cev1.SideEffect_SIDE_EFFECT_NETWORK_READ,
			Builtin:         true,
		}},
		Environment: &cev1.SessionEnvironment{Surface: "chat", TimeZone: "Europe/Paris"},
	}
}

func run(ctx context.Context, client cev1.ContextEngineClient, tenant string) error {
	sessionID := newUUID()
	planned, err := client.Plan(ctx, &cev1.PlanRequest{TenantId: tenant, SessionId: sessionID, Spec: spec()})
	if err != nil {
		return decode(err)
	}
	plan := planned.GetPlan()
	fmt.Printf("session %s: epoch %d, prefix %s (%d tokens)\n",
		sessionID, plan.GetEpoch(), plan.GetPrefixSha256(), plan.GetPrefixTokens())

	started, err := client.StartRun(ctx, &cev1.StartRunRequest{
		TenantId: tenant, SessionId: sessionID, IdempotencyKey: newUUID(),
		Seed: &cev1.StartRunRequest_UserMessage{UserMessage: &cev1.UserMessage{Text: "Trains to Lyon?"}},
	})
	if err != nil {
		return decode(err)
	}
	runID, version := started.GetRun().GetRunId(), started.GetCheckpointVersion()

	appended, err := client.AppendItems(ctx, &cev1.AppendItemsRequest{
		TenantId: tenant, SessionId: sessionID, RunId: runID,
		ExpectedCheckpointVersion: version, IdempotencyKey: newUUID(),
		Items: []*cev1.ConversationItem{
			{Kind: &cev1.ConversationItem_ToolCall{ToolCall: &cev1.ToolCall{
				CallId: "call-1", ToolName: "web.fetch", ArgumentsJson: `{"url":"https://trains.example"}`,
			}}},
			{Kind: &cev1.ConversationItem_ToolResult{ToolResult: &cev1.ToolResult{
				CallId: "call-1", ToolName: "web.fetch", Content: "08:04 TGV 6601",
				Trust: cev1.TrustLevel_TRUST_LEVEL_EXTERNAL_UNTRUSTED, Source: "tool:web.fetch",
			}}},
		},
	})
	if err != nil {
		return decode(err)
	}
	version = appended.GetCheckpointVersion()

	now := timestamppb.New(time.Date(2026, 3, 14, 23, 40, 0, 0, time.UTC))
	build := func() (*cev1.BuildResponse, error) {
		return client.Build(ctx, &cev1.BuildRequest{
			TenantId: tenant, SessionId: sessionID, RunId: runID, CheckpointVersion: version, Now: now,
		})
	}
	first, err := build()
	if err != nil {
		return decode(err)
	}
	second, err := build()
	if err != nil {
		return decode(err)
	}
	fmt.Printf("build: prefix %s request %s (%s, %d payload bytes)\n",
		first.GetPrefixSha256(), first.GetRequestSha256(), first.GetProviderApi(), len(first.GetProviderPayload()))
	if first.GetPrefixSha256() != plan.GetPrefixSha256() || second.GetPrefixSha256() != plan.GetPrefixSha256() {
		return errors.New("prefix hash changed within one epoch")
	}
	if first.GetRequestSha256() != second.GetRequestSha256() {
		return errors.New("two builds of one checkpoint differ")
	}

	// A result for a call that was never made is rejected with a reason and a field path.
	_, err = client.AppendItems(ctx, &cev1.AppendItemsRequest{
		TenantId: tenant, SessionId: sessionID, RunId: runID,
		ExpectedCheckpointVersion: version, IdempotencyKey: newUUID(),
		Items: []*cev1.ConversationItem{{Kind: &cev1.ConversationItem_ToolResult{ToolResult: &cev1.ToolResult{
			CallId: "never-called", ToolName: "web.fetch", Content: "x",
			Trust: cev1.TrustLevel_TRUST_LEVEL_EXTERNAL_UNTRUSTED,
		}}}},
	})
	var engineErr *EngineError
	if !errors.As(decode(err), &engineErr) || engineErr.Reason != "ORPHANED_TOOL_ITEM" {
		return fmt.Errorf("expected ORPHANED_TOOL_ITEM, got %v", err)
	}
	fmt.Printf("rejected: %s at %s\n", engineErr.Reason, engineErr.Field)

	// A rotation carries an idempotency key: when its answer is lost (UNAVAILABLE after
	// the commit landed), resending the same request answers with the plan it made
	// instead of ABORTED EPOCH_CONFLICT. The second call below is that resend.
	rotate := &cev1.RotateRequest{
		TenantId: tenant, SessionId: sessionID, FromEpoch: plan.GetEpoch(),
		Reason: cev1.PlanReason_PLAN_REASON_OPERATOR_REVOCATION, IdempotencyKey: newUUID(),
	}
	rotated, err := client.Rotate(ctx, rotate)
	if err != nil {
		return decode(err)
	}
	resent, err := client.Rotate(ctx, rotate)
	if err != nil {
		return decode(err)
	}
	if resent.GetPlan().GetEpoch() != rotated.GetPlan().GetEpoch() {
		return errors.New("a resent rotation rotated again")
	}
	// Under a new key it is another rotation from an epoch no longer current: a lost race,
	// with the current epoch in the ErrorInfo metadata.
	rotate.IdempotencyKey = newUUID()
	_, err = client.Rotate(ctx, rotate)
	if !errors.As(decode(err), &engineErr) || engineErr.Reason != "EPOCH_CONFLICT" {
		return fmt.Errorf("expected EPOCH_CONFLICT, got %v", err)
	}
	fmt.Printf("rotated once to epoch %d; rejected: %s, current_epoch %s\n",
		rotated.GetPlan().GetEpoch(), engineErr.Reason, engineErr.Metadata["current_epoch"])
	fmt.Println("ok: one prefix hash, identical rebuilds")
	return nil
}

func main() {
	target := flag.String("target", envOr("CONTEXT_ENGINE_TARGET", "127.0.0.1:50051"), "engine host:port")
	tenant := flag.String("tenant", envOr("CONTEXT_ENGINE_TENANT", "example"), "tenant id")
	token := flag.String("token", os.Getenv("CONTEXT_ENGINE_TOKEN"), "bearer token (optional)")
	flag.Parse()

	// A sidecar talks plaintext over localhost. WithInsecure works on every grpc-go since
	// 1.0 (newer code may prefer credentials/insecure, which needs grpc-go >= 1.34).
	conn, err := grpc.Dial(*target, grpc.WithInsecure()) //nolint:staticcheck
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if *token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+*token)
	}
	if err := run(ctx, cev1.NewContextEngineClient(conn), *tenant); err != nil {
		log.Fatal(err)
	}
}

// newUUID returns a random (version 4) UUID for session ids and idempotency keys.
func newUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}
