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
//     before AppendItems: a call logged under its wire name names a tool the plan does
//     not have, so the log reads another name than the model was offered.
//   - Usage: after appending the model's output, ReportUsage with what the provider
//     counted, under a key derived from the build ("usage:<session>:<request_sequence>",
//     as the Python and TypeScript clients make it), so a resend counts once. A report
//     that still fails is kept and sent again later (its step is logged already).
//   - A write that landed first: an append refused ABORTED CHECKPOINT_VERSION_CONFLICT
//     (the user's next message, say) is sent once more, under the same key, at the
//     metadata's latest_version, so the step's tool results are not lost (appendStep).
//   - Compaction: when Build answers NeedsCompaction, PrepareCompaction, summarize (a
//     model call of the worker's own: the engine's prompt and input), CommitCompaction,
//     and build again (compact). -steps N runs N tool steps; -policy-cap T caps the
//     request at T tokens with 1,024 for the answer, so a short run shows it.
//   - Transport: plaintext only to a sidecar on loopback. -tls (system roots) or -ca-file
//     for anything else; a -token is refused over plaintext to another host, as the Python
//     and TypeScript clients refuse it.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	cev1 "github.com/context-engine/context-engine/clients/go/contextenginev1"
)

// serviceConfig retries UNAVAILABLE (nothing else) on every method but Build, as the
// Python and TypeScript clients' channels do. grpc-go 1.33 applies it only when the process
// starts with GRPC_GO_RETRY=on in its environment (read once, at package initialization:
// an os.Setenv in main is too late); without it the policy is parsed and ignored. A resend
// is safe for the keyed writes because each carries an idempotency key (docs/api.md,
// Retries). A Build whose answer was lost may have been recorded, and a resend records
// another request no usage is reported for: Build's own entry, which its method name makes
// the one that applies, has no retry policy. DEADLINE_EXCEEDED is not retried: the call's
// deadline is spent.
const serviceConfig = `{"methodConfig": [{
  "name": [{"service": "context_engine.v1.ContextEngine"}],
  "retryPolicy": {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"]
  }
}, {
  "name": [{"service": "context_engine.v1.ContextEngine", "method": "Build"}]
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
// A timeout of 0 is no deadline, as in the Python and TypeScript clients (a deadline of 0
// had already passed: every call failed DEADLINE_EXCEEDED without being sent).
func call[Req, Resp any](ctx context.Context, timeout time.Duration,
	rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	resp, err := rpc(ctx, req)
	return resp, decode(err)
}

// maxAttempts bounds send: the first attempt and two resends.
const maxAttempts = 3

// send makes a keyed write, resending the same req (so under the key it was first sent
// with: the first attempt may have landed with only its answer lost, and a new key would
// write twice) while the error is Retryable, after a growing pause. After
// DEADLINE_EXCEEDED the next attempt gets twice the deadline: the server may just be slow
// (no deadline, a timeout of 0, stays none).
func send[Req, Resp any](ctx context.Context, timeout time.Duration,
	rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	pause := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		resp, err := call(ctx, timeout, rpc, req)
		var engineErr *EngineError
		if attempt == maxAttempts || !errors.As(err, &engineErr) || !engineErr.Retryable() {
			return resp, err // nil on success
		}
		if engineErr.Code == codes.DeadlineExceeded && timeout > 0 {
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
// named by b.ProviderApi and parses the answer. Its call id is the step's.
func askModel(b *cev1.BuildResponse, step int) (modelTurn, error) {
	payload, err := payloadToSend(b)
	if err != nil {
		return modelTurn{}, err
	}
	if !bytes.Contains(payload, []byte(`"web-fetch"`)) {
		return modelTurn{}, errors.New("the payload does not offer web.fetch as web-fetch")
	}
	return modelTurn{
		model: b.GetRequest().GetModelId(), callID: fmt.Sprintf("call-%d", step), wireName: "web-fetch",
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
	// The policy cap (tokens; 0: the model's window) and the usage reports not yet sent.
	policyCap  int64
	unreported []*cev1.ReportUsageRequest
}

func spec(policyCap int64) *cev1.PlanSpec {
	s := &cev1.PlanSpec{
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
	if policyCap > 0 { // the answer then has 1,024 tokens of it
		s.PolicyCapTokens, s.ReserveOutputTokens = policyCap, 1024
	}
	return s
}

func (w *worker) open(ctx context.Context) error {
	w.session = newUUID()
	planned, err := call(ctx, w.timeout, w.client.Plan,
		&cev1.PlanRequest{TenantId: w.tenant, SessionId: w.session, Spec: spec(w.policyCap)})
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

// buildAgain names the refusals after which a Build is sent once more (worker.build).
var buildAgain = map[string]bool{"EPOCH_CONFLICT": true, "SESSION_BUSY": true, "SHUTTING_DOWN": true}

func (w *worker) build(ctx context.Context, now *timestamppb.Timestamp) (*cev1.BuildResponse, error) {
	request := &cev1.BuildRequest{
		TenantId: w.tenant, SessionId: w.session, RunId: w.runID, CheckpointVersion: w.version, Now: now,
	}
	// Built once more after a refusal that recorded nothing: ABORTED SESSION_BUSY,
	// EPOCH_CONFLICT (an erasure invalidated the plan while the request was built:
	// docs/api.md says build again), or UNAVAILABLE SHUTTING_DOWN (a draining replica
	// refused it before its handler ran; the channel does not resend a Build). Not after
	// any other UNAVAILABLE or DEADLINE_EXCEEDED, which may
	// come after the record: another Build would leave it a request no usage is reported
	// for, first of its epoch in the record while the one sent is not.
	for compactions := 0; ; compactions++ {
		built, err := call(ctx, w.timeout, w.client.Build, request)
		var engineErr *EngineError
		if errors.As(err, &engineErr) && buildAgain[engineErr.Reason] {
			built, err = call(ctx, w.timeout, w.client.Build, request)
		}
		if err != nil {
			return nil, err
		}
		if !built.GetNeedsCompaction() {
			return built, w.checkPrefix(ctx, built)
		}
		// The history outgrew the body. One compaction may not be enough (the engine does
		// not know the next Build's step lines): Build asks again, and summaries merge.
		if compactions == maxCompactions {
			return nil, fmt.Errorf("still needs compaction after %d compactions", compactions)
		}
		if err := w.compact(ctx); err != nil {
			return nil, err
		}
		request.CheckpointVersion = w.version
	}
}

// maxCompactions bounds the compactions one build makes: summaries merge once, so the
// server refuses a third (COMPACTION_DEPTH_EXCEEDED) whichever build asks for it.
const maxCompactions = 2

// compact replaces the run's oldest history with a summary: PrepareCompaction, the
// worker's summarizer, then CommitCompaction against the version it was prepared from,
// under a key of its own (send resends it as it is).
func (w *worker) compact(ctx context.Context) error {
	prepared, err := call(ctx, w.timeout, w.client.PrepareCompaction, &cev1.PrepareCompactionRequest{
		TenantId: w.tenant, SessionId: w.session, RunId: w.runID, CheckpointVersion: w.version,
	})
	if err != nil {
		return err
	}
	fmt.Printf("compacting through event %d (%d tokens)\n",
		prepared.GetReplacedThroughSequence(), prepared.GetTokensBefore())
	summary := summarize(prepared)
	committed, err := send(ctx, w.timeout, w.client.CommitCompaction, &cev1.CommitCompactionRequest{
		TenantId: w.tenant, SessionId: w.session, RunId: w.runID,
		ExpectedCheckpointVersion: prepared.GetCheckpointVersion(), IdempotencyKey: newUUID(),
		Result: &cev1.CompactionResult{
			Summary:                 summary,
			SourceEventIds:          prepared.GetSourceEventIds(),
			Elided:                  prepared.GetElided(),
			ReplacedThroughSequence: prepared.GetReplacedThroughSequence(),
			Depth:                   prepared.GetDepth(),
			TokensBefore:            prepared.GetTokensBefore(),
			// Conservative when the worker does not count: one token per three bytes.
			TokensAfter:      int64(len(summary)+2) / 3,
			CompactorVersion: "go-example@1",
			PromptVersion:    prepared.GetPromptVersion(),
		},
	})
	if err != nil {
		return err
	}
	w.setVersion(committed.GetCheckpointVersion())
	return nil
}

// summarize stands in for the summarizer's model call: a real worker sends
// prepared.Prompt as the instructions and prepared.SummarizerInput as the input to its
// model, and commits the text it answers. What the summary must keep it keeps verbatim:
// the user's constraints, and their open questions as open.
func summarize(prepared *cev1.PrepareCompactionResponse) string {
	var b strings.Builder
	b.WriteString("Earlier in this run the user asked for trains to Lyon and timetable pages were fetched.")
	for _, c := range prepared.GetRetainedConstraints() {
		b.WriteString("\nConstraint: " + c)
	}
	for _, q := range prepared.GetOpenQuestions() {
		b.WriteString("\nOpen question: " + q)
	}
	return b.String()
}

// setVersion takes v as the run's checkpoint version when it is newer. Never older: a
// resent write replays its first answer, whose version later writes may have passed.
func (w *worker) setVersion(v int64) {
	if v > w.version {
		w.version = v
	}
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
	request := &cev1.AppendItemsRequest{
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
	}
	appended, err := send(ctx, w.timeout, w.client.AppendItems, request)
	if latest, moved := movedOn(err, request); moved {
		// Another write landed first (the user's next message, say): the step goes after
		// it, under the same key. Given up, its tools' results would be lost.
		request.ExpectedCheckpointVersion = latest
		appended, err = send(ctx, w.timeout, w.client.AppendItems, request)
	}
	if err != nil {
		return err
	}
	w.setVersion(appended.GetCheckpointVersion())
	return nil
}

// movedOn reads an append refused CHECKPOINT_VERSION_CONFLICT for a later version than
// request expected: that version, and true.
func movedOn(err error, request *cev1.AppendItemsRequest) (int64, bool) {
	var engineErr *EngineError
	if !errors.As(err, &engineErr) || engineErr.Reason != "CHECKPOINT_VERSION_CONFLICT" {
		return 0, false
	}
	latest, parsed := strconv.ParseInt(engineErr.Metadata["latest_version"], 10, 64)
	return latest, parsed == nil && latest > request.GetExpectedCheckpointVersion()
}

// reportUsage reports what the provider counted for b's request, after the model's
// output is appended: a report that fails then loses nothing, and can be resent. The key
// is the build's own, so a resend after a lost answer counts once.
// A report that still fails is kept (w.unreported) and sent again with the next one: the
// step it belongs to is logged, so failing the run for it would lose nothing but the run.
func (w *worker) reportUsage(ctx context.Context, b *cev1.BuildResponse, turn modelTurn) error {
	w.unreported = append(w.unreported, &cev1.ReportUsageRequest{
		TenantId: w.tenant, SessionId: w.session, RequestSequence: b.GetRequestSequence(),
		ModelId: turn.model, InputTokens: turn.inputTokens, OutputTokens: turn.outputTokens,
		IdempotencyKey: fmt.Sprintf("usage:%s:%d", w.session, b.GetRequestSequence()),
	})
	return w.flushUsage(ctx)
}

// flushUsage sends the reports not sent yet, keeping those that fail retryably.
func (w *worker) flushUsage(ctx context.Context) error {
	pending := w.unreported[:0]
	for _, report := range w.unreported {
		if _, err := send(ctx, w.timeout, w.client.ReportUsage, report); err != nil {
			var engineErr *EngineError
			if errors.As(err, &engineErr) && !engineErr.Retryable() {
				return err // refused for what it says: sent again, it fails again
			}
			fmt.Printf("usage for request %d not reported yet: %v\n", report.GetRequestSequence(), err)
			pending = append(pending, report)
			continue
		}
		fmt.Printf("reported usage for request %d\n", report.GetRequestSequence())
	}
	w.unreported = pending
	if len(pending) > 0 {
		fmt.Printf("%d usage reports not sent yet: resend them later, under their keys\n", len(pending))
	}
	return nil
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

// showLateStep logs a step whose append meets a write that landed after its build (the
// user's next message, here appended by the example itself): refused
// CHECKPOINT_VERSION_CONFLICT, appendStep sends it again after that write, under its key.
func (w *worker) showLateStep(ctx context.Context, now *timestamppb.Timestamp, step int) error {
	built, err := w.build(ctx, now)
	if err != nil {
		return err
	}
	answer, err := askModel(built, step)
	if err != nil {
		return err
	}
	_, err = send(ctx, w.timeout, w.client.AppendItems, &cev1.AppendItemsRequest{
		TenantId: w.tenant, SessionId: w.session, RunId: w.runID,
		ExpectedCheckpointVersion: w.version, IdempotencyKey: newUUID(),
		Items: []*cev1.ConversationItem{{Kind: &cev1.ConversationItem_UserMessage{
			UserMessage: &cev1.UserMessage{Text: "Actually, after 9:00 please."},
		}}},
	})
	if err != nil { // the other writer's version is not w.version: the step's is behind
		return err
	}
	before := w.version
	if err := w.appendStep(ctx, built, answer, "09:04 TGV 6603"); err != nil {
		return err
	}
	fmt.Printf("a step after a write that landed first: appended at version %d (built at %d)\n",
		w.version, before)
	return w.reportUsage(ctx, built, answer)
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

// turn is `steps` tool steps of a run, then the error and retry demonstrations.
func (w *worker) turn(ctx context.Context, steps int) error {
	if err := w.open(ctx); err != nil {
		return err
	}
	if err := w.startRun(ctx, "Trains to Lyon?"); err != nil {
		return err
	}
	now := timestamppb.New(time.Date(2026, 3, 14, 23, 40, 0, 0, time.UTC))
	for step := 1; step <= steps; step++ {
		built, err := w.build(ctx, now)
		if err != nil {
			return err
		}
		answer, err := askModel(built, step)
		if err != nil {
			return err
		}
		page := fmt.Sprintf("Timetable page %d: %s", step, strings.Repeat("08:04 TGV 6601, 09:04 TGV 6603. ", 12))
		if err := w.appendStep(ctx, built, answer, page); err != nil {
			return err
		}
		if err := w.reportUsage(ctx, built, answer); err != nil {
			return err
		}
	}
	if err := w.showLateStep(ctx, now, steps+1); err != nil {
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
	// The reports still failing: sent once more; what is left is for a later session
	// of this worker to send (their keys make a resend count once).
	if err := w.flushUsage(ctx); err != nil {
		return err
	}
	fmt.Println("ok: one prefix hash, identical rebuilds")
	return nil
}

// dial opens the connection. Beyond the stubs' defaults: no receive limit, as a Build or
// GetBuild answer can exceed grpc-go's 4 MiB default (the server does not cap what it
// sends); the retry policy above; and a 16 MiB retry buffer, as a call is
// resent only while its request fits (256 KiB per call by default).
func dial(target string, transport grpc.DialOption) (*grpc.ClientConn, error) {
	return grpc.Dial(target,
		transport,
		grpc.WithDefaultServiceConfig(serviceConfig),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(math.MaxInt32),
			grpc.MaxRetryRPCBufferSize(16<<20),
		),
	)
}

// transportFor is TLS when asked for (-tls: the system's roots; -ca-file: that CA), else
// plaintext, which a sidecar on loopback talks. A token is not sent over plaintext to
// another host: anyone on the path could read it and act as the worker.
func transportFor(target, caFile string, useTLS bool, token string) (grpc.DialOption, error) {
	switch {
	case caFile != "":
		creds, err := credentials.NewClientTLSFromFile(caFile, "")
		if err != nil {
			return nil, err
		}
		return grpc.WithTransportCredentials(creds), nil
	case useTLS:
		return grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12})), nil
	case token != "" && !loopback(target):
		return nil, fmt.Errorf("a -token is not sent over plaintext to %s: use -tls or -ca-file", target)
	}
	// WithInsecure works on every grpc-go since 1.0 (newer code may prefer
	// credentials/insecure, which needs grpc-go >= 1.34).
	return grpc.WithInsecure(), nil //nolint:staticcheck
}

// loopback: whether a gRPC target names this host, by the Python and TypeScript clients'
// rule: a loopback address, localhost (any case), or a Unix socket; for an ipv4:/ipv6:
// list, every address; a dns: scheme is read past. A name is not (it may resolve
// elsewhere). It read host:port only, and refused a token to unix: and dns:/// targets the
// other clients take (a review).
func loopback(target string) bool {
	if strings.HasPrefix(target, "unix:") || strings.HasPrefix(target, "unix-abstract:") {
		return true
	}
	for _, scheme := range []string{"ipv4:", "ipv6:"} {
		if strings.HasPrefix(target, scheme) {
			for _, address := range strings.Split(strings.TrimPrefix(target, scheme), ",") {
				if !oneLoopback(address) {
					return false
				}
			}
			return true
		}
	}
	for _, scheme := range []string{"dns:///", "dns:"} {
		target = strings.TrimPrefix(target, scheme)
	}
	return oneLoopback(target)
}

// oneLoopback: whether one address (host, host:port, [v6]:port) names this host.
func oneLoopback(target string) bool {
	host := target
	if strings.Count(target, ":") == 1 {
		host = target[:strings.LastIndex(target, ":")]
	}
	if strings.HasPrefix(host, "[") {
		host = strings.TrimPrefix(host, "[")
		if end := strings.Index(host, "]"); end >= 0 {
			host = host[:end]
		}
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// run returns its error rather than exiting, so the deferred Close runs.
func run(target, tenant, token, caFile string, useTLS bool, timeout time.Duration, steps int, policyCap int64) error {
	transport, err := transportFor(target, caFile, useTLS, token)
	if err != nil {
		return err
	}
	conn, err := dial(target, transport)
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx := context.Background()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	w := &worker{client: cev1.NewContextEngineClient(conn), tenant: tenant, timeout: timeout, policyCap: policyCap}
	return w.turn(ctx, steps)
}

// deadlineFlag is -timeout: a duration, 0 for no deadline. A negative one is refused as
// the flags are parsed: it was a deadline already past, and every RPC failed.
type deadlineFlag time.Duration

func (d *deadlineFlag) String() string { return time.Duration(*d).String() }

func (d *deadlineFlag) Set(value string) error {
	parsed, err := time.ParseDuration(value)
	if err != nil {
		return err
	}
	if parsed < 0 {
		return errors.New("must not be negative (0: no deadline)")
	}
	*d = deadlineFlag(parsed)
	return nil
}

func main() {
	target := flag.String("target", envOr("CONTEXT_ENGINE_TARGET", "127.0.0.1:50051"), "engine host:port")
	tenant := flag.String("tenant", envOr("CONTEXT_ENGINE_TENANT", "example"), "tenant id")
	token := flag.String("token", os.Getenv("CONTEXT_ENGINE_TOKEN"), "bearer token (optional)")
	deadline := deadlineFlag(30 * time.Second)
	flag.Var(&deadline, "timeout", "deadline of each RPC, a `duration` (0: none)")
	timeout := (*time.Duration)(&deadline)
	useTLS := flag.Bool("tls", false, "TLS with the system's root certificates")
	caFile := flag.String("ca-file", "", "TLS, trusting this PEM CA certificate")
	steps := flag.Int("steps", 1, "tool steps of the run")
	policyCap := flag.Int64("policy-cap", 0, "cap the request at this many tokens (0: the model's window)")
	flag.Parse()
	if err := run(*target, *tenant, *token, *caFile, *useTLS, *timeout, *steps, *policyCap); err != nil {
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
