// Command worker is an example agent worker in Go: it opens a session, starts a run,
// builds the request, takes the model's tool call (under the provider's wire name) back to
// the plan's tool name, appends the call and its result, reports the model's usage, builds
// again (twice) and checks that the prefix hash held and that Build is pure (the same
// request hash and payload bytes). It also shows how to read the structured error details
// (ErrorInfo reason, domain and metadata, BadRequest field violations) the engine sends,
// and how a write with an idempotency key is retried safely (send resends the same
// request, key included, while the error is Retryable; a Rotate is resent as after a lost
// answer).
//
//	./check.sh /tmp/worker && GRPC_GO_RETRY=on /tmp/worker -target 127.0.0.1:50051 -tenant example
//
// (or, where the Go module proxy is reachable: go mod tidy, then GRPC_GO_RETRY=on go run
// ./examples/worker with the same flags). Without GRPC_GO_RETRY=on grpc-go 1.33 does not
// retry.
//
// A real worker POSTs the payload to the API named by BuildResponse.ProviderApi; the
// engine never calls a model itself. What a worker must do around that call:
//
//   - Attachments: a user message's attachments are not in ProviderPayload. When
//     BuildResponse.AttachmentPlacements is not empty, insert each message's attachment
//     parts into the content list at its PayloadPath, just before the part it names (the
//     last placement first), sending each attachment's content or its marker as its
//     AttachmentSend.Content says (docs/api.md, Build). This example sends none and
//     refuses a build that has any (payloadToSend).
//   - Tool names: providers accept [A-Za-z0-9_-] only, so the model answers with wire
//     names ("web-fetch" for "web.fetch"). Map them back to the plan's names (toolName)
//     before AppendItems: a call logged under its wire name is a second tool with the
//     same wire name, and the next Build fails TOOL_NAME_COLLISION.
//   - Usage: after appending the model's output, ReportUsage with what the provider
//     counted, under a key derived from the build ("usage:<session>:<request_sequence>",
//     as the Python and TypeScript clients make it), so a resend counts once.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"log"
	"math"
	"os"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	cev1 "github.com/context-engine/context-engine/clients/go/contextenginev1"
)

// serviceConfig retries UNAVAILABLE (nothing else) on every method, as the Python and
// TypeScript clients' channels do. grpc-go 1.33 applies it only when the process starts
// with GRPC_GO_RETRY=on in its environment (read once, at package initialization: an
// os.Setenv in main is too late); without it the policy is parsed and ignored. A resend is
// safe for the keyed writes because each carries an idempotency key (docs/api.md, Retries).
// DEADLINE_EXCEEDED is not retried: the call's deadline is spent.
const serviceConfig = `{"methodConfig": [{
  "name": [{"service": "context_engine.v1.ContextEngine"}],
  "retryPolicy": {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"]
  }
}]}`

// maxWireName is the longest tool name the providers accept (OpenAI's 64).
const maxWireName = 64

// EngineError is a failed RPC with the engine's structured details decoded. It keeps the
// status it came from (GRPCStatus), so status.Code(err) and status.Convert(err) still work.
type EngineError struct {
	Code            codes.Code
	Msg             string
	Reason          string                                  // ErrorInfo.reason, e.g. "ORPHANED_TOOL_ITEM"
	Domain          string                                  // ErrorInfo.domain, "context-engine"
	Metadata        map[string]string                       // ErrorInfo.metadata, e.g. {"current_epoch": "2"}
	FieldViolations []*errdetails.BadRequest_FieldViolation // every BadRequest violation, in order
	status          *status.Status
}

func (e *EngineError) Error() string {
	out := fmt.Sprintf("%s: %s", e.Code, e.Msg)
	if e.Reason != "" {
		out += " [" + e.Reason + "]"
	}
	for _, v := range e.FieldViolations {
		out += fmt.Sprintf(" field=%q", v.GetField())
	}
	return out
}

// GRPCStatus is the status the error was decoded from.
func (e *EngineError) GRPCStatus() *status.Status { return e.status }

// Field is the first offending field path, e.g. "items[0].tool_result.call_id"; "" when
// the server named none.
func (e *EngineError) Field() string {
	if len(e.FieldViolations) == 0 {
		return ""
	}
	return e.FieldViolations[0].GetField()
}

// Retryable reports UNAVAILABLE and DEADLINE_EXCEEDED, and ABORTED SESSION_BUSY (another
// write held the session past the server's lock wait; nothing was written), as the Python
// and TypeScript clients do: resend with backoff, a keyed write under the idempotency key
// it was first sent with (it may have landed with only its answer lost). Not another
// ABORTED: a lost race is re-read first, then retried.
func (e *EngineError) Retryable() bool {
	return e.Code == codes.Unavailable || e.Code == codes.DeadlineExceeded ||
		(e.Code == codes.Aborted && e.Reason == "SESSION_BUSY")
}

// decode turns a gRPC error into an *EngineError (nil and other errors pass through). A
// detail that cannot be read is left out; the error keeps its code and message.
func decode(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	out := &EngineError{Code: st.Code(), Msg: st.Message(), status: st}
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			out.Reason, out.Domain, out.Metadata = d.GetReason(), d.GetDomain(), d.GetMetadata()
		case *errdetails.BadRequest:
			out.FieldViolations = append(out.FieldViolations, d.GetFieldViolations()...)
		}
	}
	return out
}

// call makes one RPC under a deadline of its own and decodes its error. The stubs set no
// deadline, and one for a whole run would leave each call only what the earlier ones left.
func call[Req, Resp any](ctx context.Context, timeout time.Duration,
	rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	resp, err := rpc(ctx, req)
	return resp, decode(err)
}

// maxAttempts bounds send: the first attempt and two resends.
const maxAttempts = 3

// send makes a keyed write, resending the same req (so under the key it was first sent
// with: the first attempt may have landed with only its answer lost, and a new key would
// write twice) while the error is Retryable, after a growing pause. After
// DEADLINE_EXCEEDED the next attempt gets twice the deadline: the server may just be slow.
func send[Req, Resp any](ctx context.Context, timeout time.Duration,
	rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	pause := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		resp, err := call(ctx, timeout, rpc, req)
		var engineErr *EngineError
		if attempt == maxAttempts || !errors.As(err, &engineErr) || !engineErr.Retryable() {
			return resp, err // nil on success
		}
		if engineErr.Code == codes.DeadlineExceeded {
			timeout *= 2
		}
		select {
		case <-time.After(pause):
		case <-ctx.Done(): // the caller gave up: resending cannot succeed
			return resp, err
		}
		pause *= 2
	}
}

// wireToolName is the name a provider sees for tool name: each character outside
// [A-Za-z0-9_-] becomes "-", cut to 64 characters ("-" if nothing is left), as the engine
// renders it.
func wireToolName(name string) string {
	var b strings.Builder
	for i, r := range []rune(name) {
		if i == maxWireName {
			break
		}
		if !isWireChar(r) {
			r = '-'
		}
		b.WriteRune(r)
	}
	if b.Len() == 0 {
		return "-"
	}
	return b.String()
}

func isWireChar(r rune) bool {
	return r == '_' || r == '-' || '0' <= r && r <= '9' || 'A' <= r && r <= 'Z' || 'a' <= r && r <= 'z'
}

// toolName maps a tool name the model answered with back to the plan's, through the
// request's own tools (as the Python and TypeScript clients do); a name no tool renders
// as comes back unchanged.
func toolName(b *cev1.BuildResponse, wire string) string {
	for _, tool := range b.GetRequest().GetTools() {
		if wireToolName(tool.GetName()) == wire {
			return tool.GetName()
		}
	}
	return wire
}

// payloadToSend is what to POST to the provider for b. Attachments are references the
// engine never resolves: a worker that sends them inserts their parts where
// b.AttachmentPlacements says. This one sends none, so it refuses rather than send a
// payload that silently lacks them.
func payloadToSend(b *cev1.BuildResponse) ([]byte, error) {
	if n := len(b.GetAttachmentPlacements()); n > 0 {
		return nil, fmt.Errorf("%d messages carry attachments: insert them at their payload_path first", n)
	}
	return b.GetProviderPayload(), nil
}

// modelTurn is what the provider answered, as much of it as this example uses: one tool
// call, under the provider's wire name, and the usage it reported.
type modelTurn struct {
	model                      string
	callID, wireName, argsJSON string
	inputTokens, outputTokens  int64
}

// askModel stands in for the provider call: a real worker POSTs the payload to the API
// named by b.ProviderApi and parses the answer.
func askModel(b *cev1.BuildResponse) (modelTurn, error) {
	payload, err := payloadToSend(b)
	if err != nil {
		return modelTurn{}, err
	}
	if !bytes.Contains(payload, []byte(`"web-fetch"`)) {
		return modelTurn{}, errors.New("the payload does not offer web.fetch as web-fetch")
	}
	return modelTurn{
		model: b.GetRequest().GetModelId(), callID: "call-1", wireName: "web-fetch",
		argsJSON: `{"url":"https://trains.example"}`, inputTokens: b.GetEstimatedInputTokens(), outputTokens: 24,
	}, nil
}

// worker is what one session's worker keeps between calls: the plan it holds (the newest
// epoch it has seen; the from_epoch of its next Rotate) and its run's latest checkpoint.
type worker struct {
	client  cev1.ContextEngineClient
	tenant  string
	timeout time.Duration // per RPC
	session string
	plan    *cev1.ContextPlan
	runID   string
	version int64
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

func (w *worker) open(ctx context.Context) error {
	w.session = newUUID()
	planned, err := call(ctx, w.timeout, w.client.Plan,
		&cev1.PlanRequest{TenantId: w.tenant, SessionId: w.session, Spec: spec()})
	if err != nil {
		return err
	}
	w.plan = planned.GetPlan()
	fmt.Printf("session %s: epoch %d, prefix %s (%d tokens)\n",
		w.session, w.plan.GetEpoch(), w.plan.GetPrefixSha256(), w.plan.GetPrefixTokens())
	return nil
}

func (w *worker) startRun(ctx context.Context, text string) error {
	started, err := send(ctx, w.timeout, w.client.StartRun, &cev1.StartRunRequest{
		TenantId: w.tenant, SessionId: w.session, IdempotencyKey: newUUID(),
		Seed: &cev1.StartRunRequest_UserMessage{UserMessage: &cev1.UserMessage{Text: text}},
	})
	if err != nil {
		return err
	}
	// Admission may rotate the epoch; a top-level run's rotated_plan is then the current
	// plan (a child's continues its parent's lineage, which need not be).
	if started.GetRun().GetParentRunId() == "" {
		w.adopt(started.GetRotatedPlan())
	}
	w.runID, w.version = started.GetRun().GetRunId(), started.GetCheckpointVersion()
	return nil
}

// adopt takes p as the held plan when its epoch is newer. Never older: a resent StartRun
// replays its first answer, whose plan may since have been rotated past.
func (w *worker) adopt(p *cev1.ContextPlan) {
	if p != nil && p.GetEpoch() > w.plan.GetEpoch() {
		w.plan = p
	}
}

func (w *worker) build(ctx context.Context, now *timestamppb.Timestamp) (*cev1.BuildResponse, error) {
	request := &cev1.BuildRequest{
		TenantId: w.tenant, SessionId: w.session, RunId: w.runID, CheckpointVersion: w.version, Now: now,
	}
	// Build writes only its record, so it is resent as any retryable call is; and once
	// after ABORTED EPOCH_CONFLICT (an erasure invalidated the plan while the request was
	// built, nothing recorded: docs/api.md says build again).
	built, err := send(ctx, w.timeout, w.client.Build, request)
	var engineErr *EngineError
	if errors.As(err, &engineErr) && engineErr.Reason == "EPOCH_CONFLICT" {
		built, err = send(ctx, w.timeout, w.client.Build, request)
	}
	if err != nil {
		return nil, err
	}
	if built.GetNeedsCompaction() {
		return nil, errors.New("needs compaction: PrepareCompaction, summarize, CommitCompaction, build again")
	}
	return built, w.checkPrefix(ctx, built)
}

// checkPrefix checks that b was built on its epoch's prefix. The epoch first: a Build may
// rotate (after an erasure, or a Rotate without spec that had not reached this run's
// lineage), and a new epoch's new prefix is by design, not a prefix that changed.
func (w *worker) checkPrefix(ctx context.Context, b *cev1.BuildResponse) error {
	plan := w.plan
	if b.GetEpoch() != plan.GetEpoch() {
		got, err := call(ctx, w.timeout, w.client.GetPlan,
			&cev1.GetPlanRequest{TenantId: w.tenant, SessionId: w.session, Epoch: b.GetEpoch()})
		if err != nil {
			return err
		}
		plan = got.GetPlan()
		w.adopt(plan) // this example's run is top-level: its lineage is the current one
	}
	if b.GetPrefixSha256() != plan.GetPrefixSha256() {
		return fmt.Errorf("prefix hash changed within epoch %d", plan.GetEpoch())
	}
	return nil
}

// appendStep logs the model's tool call, under the plan's tool name, and its result in
// one write, so the log never holds a call without its result.
func (w *worker) appendStep(ctx context.Context, b *cev1.BuildResponse, turn modelTurn, result string) error {
	name := toolName(b, turn.wireName)
	fmt.Printf("tool call %s -> %s\n", turn.wireName, name)
	appended, err := send(ctx, w.timeout, w.client.AppendItems, &cev1.AppendItemsRequest{
		TenantId: w.tenant, SessionId: w.session, RunId: w.runID,
		ExpectedCheckpointVersion: w.version, IdempotencyKey: newUUID(),
		Items: []*cev1.ConversationItem{
			{Kind: &cev1.ConversationItem_ToolCall{ToolCall: &cev1.ToolCall{
				CallId: turn.callID, ToolName: name, ArgumentsJson: turn.argsJSON,
			}}},
			{Kind: &cev1.ConversationItem_ToolResult{ToolResult: &cev1.ToolResult{
				CallId: turn.callID, ToolName: name, Content: result,
				Trust: cev1.TrustLevel_TRUST_LEVEL_EXTERNAL_UNTRUSTED, Source: "tool:" + name,
			}}},
		},
	})
	if err != nil {
		return err
	}
	w.version = appended.GetCheckpointVersion()
	return nil
}

// reportUsage reports what the provider counted for b's request, after the model's
// output is appended: a report that fails then loses nothing, and can be resent. The key
// is the build's own, so a resend after a lost answer counts once.
func (w *worker) reportUsage(ctx context.Context, b *cev1.BuildResponse, turn modelTurn) error {
	_, err := send(ctx, w.timeout, w.client.ReportUsage, &cev1.ReportUsageRequest{
		TenantId: w.tenant, SessionId: w.session, RequestSequence: b.GetRequestSequence(),
		ModelId: turn.model, InputTokens: turn.inputTokens, OutputTokens: turn.outputTokens,
		IdempotencyKey: fmt.Sprintf("usage:%s:%d", w.session, b.GetRequestSequence()),
	})
	if err == nil {
		fmt.Printf("reported usage for request %d\n", b.GetRequestSequence())
	}
	return err
}

// rebuild builds the run's checkpoint twice with one clock and checks that Build is pure:
// the same request hash and the same payload bytes.
func (w *worker) rebuild(ctx context.Context, now *timestamppb.Timestamp) error {
	first, err := w.build(ctx, now)
	if err != nil {
		return err
	}
	second, err := w.build(ctx, now)
	if err != nil {
		return err
	}
	fmt.Printf("build: prefix %s request %s (%s, %d payload bytes)\n",
		first.GetPrefixSha256(), first.GetRequestSha256(), first.GetProviderApi(), len(first.GetProviderPayload()))
	if first.GetRequestSha256() != second.GetRequestSha256() ||
		!bytes.Equal(first.GetProviderPayload(), second.GetProviderPayload()) {
		return errors.New("two builds of one checkpoint differ")
	}
	return nil
}

// showRejection appends a result for a call that was never made: rejected with a reason
// and a field path, and nothing written.
func (w *worker) showRejection(ctx context.Context) error {
	_, err := call(ctx, w.timeout, w.client.AppendItems, &cev1.AppendItemsRequest{
		TenantId: w.tenant, SessionId: w.session, RunId: w.runID,
		ExpectedCheckpointVersion: w.version, IdempotencyKey: newUUID(),
		Items: []*cev1.ConversationItem{{Kind: &cev1.ConversationItem_ToolResult{ToolResult: &cev1.ToolResult{
			CallId: "never-called", ToolName: "web.fetch", Content: "x",
			Trust: cev1.TrustLevel_TRUST_LEVEL_EXTERNAL_UNTRUSTED,
		}}}},
	})
	var engineErr *EngineError
	if !errors.As(err, &engineErr) || engineErr.Reason != "ORPHANED_TOOL_ITEM" {
		return fmt.Errorf("expected ORPHANED_TOOL_ITEM, got %v", err)
	}
	if status.Code(err) != codes.InvalidArgument || engineErr.Retryable() {
		return fmt.Errorf("expected a final INVALID_ARGUMENT, got %v", err)
	}
	fmt.Printf("rejected: %s at %s\n", engineErr.Reason, engineErr.Field())
	return nil
}

// showRotation rotates under an idempotency key and resends it, as after a lost answer
// (UNAVAILABLE after the commit landed): the resend answers with the plan the first made
// instead of ABORTED EPOCH_CONFLICT. Under a new key it is another rotation from an epoch
// no longer current: a lost race, with the current epoch in the ErrorInfo metadata.
func (w *worker) showRotation(ctx context.Context) error {
	rotate := &cev1.RotateRequest{
		TenantId: w.tenant, SessionId: w.session, FromEpoch: w.plan.GetEpoch(),
		Reason: cev1.PlanReason_PLAN_REASON_OPERATOR_REVOCATION, IdempotencyKey: newUUID(),
	}
	rotated, err := call(ctx, w.timeout, w.client.Rotate, rotate)
	if err != nil {
		return err
	}
	resent, err := call(ctx, w.timeout, w.client.Rotate, rotate)
	if err != nil {
		return err
	}
	if resent.GetPlan().GetEpoch() != rotated.GetPlan().GetEpoch() {
		return errors.New("a resent rotation rotated again")
	}
	w.adopt(rotated.GetPlan())
	rotate.IdempotencyKey = newUUID()
	_, err = call(ctx, w.timeout, w.client.Rotate, rotate)
	var engineErr *EngineError
	if !errors.As(err, &engineErr) || engineErr.Reason != "EPOCH_CONFLICT" {
		return fmt.Errorf("expected EPOCH_CONFLICT, got %v", err)
	}
	fmt.Printf("rotated once to epoch %d; rejected: %s, current_epoch %s\n",
		rotated.GetPlan().GetEpoch(), engineErr.Reason, engineErr.Metadata["current_epoch"])
	return nil
}

// turn is one tool step of a run, then the error and retry demonstrations.
func (w *worker) turn(ctx context.Context) error {
	if err := w.open(ctx); err != nil {
		return err
	}
	if err := w.startRun(ctx, "Trains to Lyon?"); err != nil {
		return err
	}
	now := timestamppb.New(time.Date(2026, 3, 14, 23, 40, 0, 0, time.UTC))
	built, err := w.build(ctx, now)
	if err != nil {
		return err
	}
	answer, err := askModel(built)
	if err != nil {
		return err
	}
	if err := w.appendStep(ctx, built, answer, "08:04 TGV 6601"); err != nil {
		return err
	}
	if err := w.reportUsage(ctx, built, answer); err != nil {
		return err
	}
	if err := w.rebuild(ctx, now); err != nil {
		return err
	}
	if err := w.showRejection(ctx); err != nil {
		return err
	}
	if err := w.showRotation(ctx); err != nil {
		return err
	}
	fmt.Println("ok: one prefix hash, identical rebuilds")
	return nil
}

// dial opens the connection. Beyond the stubs' defaults: no receive limit, as a Build or
// GetBuild answer can exceed grpc-go's 4 MiB default (the server does not cap what it
// sends); the retry policy above; and a 16 MiB retry buffer, as a call is
// resent only while its request fits (256 KiB per call by default).
func dial(target string) (*grpc.ClientConn, error) {
	// A sidecar talks plaintext over localhost. WithInsecure works on every grpc-go since
	// 1.0 (newer code may prefer credentials/insecure, which needs grpc-go >= 1.34).
	return grpc.Dial(target,
		grpc.WithInsecure(), //nolint:staticcheck
		grpc.WithDefaultServiceConfig(serviceConfig),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(math.MaxInt32),
			grpc.MaxRetryRPCBufferSize(16<<20),
		),
	)
}

// run returns its error rather than exiting, so the deferred Close runs.
func run(target, tenant, token string, timeout time.Duration) error {
	conn, err := dial(target)
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx := context.Background()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	w := &worker{client: cev1.NewContextEngineClient(conn), tenant: tenant, timeout: timeout}
	return w.turn(ctx)
}

func main() {
	target := flag.String("target", envOr("CONTEXT_ENGINE_TARGET", "127.0.0.1:50051"), "engine host:port")
	tenant := flag.String("tenant", envOr("CONTEXT_ENGINE_TENANT", "example"), "tenant id")
	token := flag.String("token", os.Getenv("CONTEXT_ENGINE_TOKEN"), "bearer token (optional)")
	timeout := flag.Duration("timeout", 30*time.Second, "deadline of each RPC")
	flag.Parse()
	if err := run(*target, *tenant, *token, *timeout); err != nil {
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
