// The typed wrapper: a client per tenant, a Session per session, a Run per turn.
//
//   const engine = new ContextEngineClient({ target: '127.0.0.1:50051', tenantId: 'acme' });
//   const session = await engine.openSession(spec);
//   const run = await session.startRun('Trains to Lyon tomorrow?');
//   const result = await run.toolLoop({ callModel, runTool });
//
// Rules the wrapper keeps so a worker does not have to:
// 1. A Run tracks the latest checkpoint version it wrote and sends it as
//    expected_checkpoint_version; a lost race surfaces as AbortedError.
// 2. Every write that is not idempotent by nature carries an idempotency key (Rotate and
//    OfferFactCandidates included), so the channel's retry policy (UNAVAILABLE only) may
//    resend it safely: a resend of a write that landed replays its answer.
// 3. Every failed RPC rejects with a typed ContextEngineError (reason + field violations).
// 4. Build is pure on the server: the same checkpoint and clock return the same bytes.

import { createHash, randomUUID } from 'node:crypto';
import * as net from 'node:net';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

import { unknownEnumValue } from './enums.js';
import {
  ClientError,
  ContextEngineError,
  DeadlineExceededError,
  InvalidArgumentError,
  NeedsCompactionError,
  ToolLoopLimitError,
  fromServiceError,
} from './errors.js';
import {
  type ModelTurn,
  type ToolCallRequest,
  type ToolOutput,
  type Usage,
  MAX_ID_CHARS,
  argumentsProblem,
  itemIdProblem,
  reasoningProblem,
  toolResult,
  turnItems,
} from './items.js';
import { PROTO_DIR } from './paths.js';
import type {
  AppendItemsRequest,
  AppendItemsResponse,
  Attachment,
  AttachmentPlacement,
  BuildResponse,
  ContextPlan,
  ConversationItem,
  EraseSubjectResponse,
  ModelRequest,
  OfferFactCandidatesResponse,
  PlanReason,
  PlanSpec,
  PrepareCompactionResponse,
  PressureReport,
  ProtoGrpcType,
  RawContextEngineClient,
  LoadSkillResponse,
  ReportUsageResponse,
  RunAdmission,
  StepContext,
  ToolSpecOutput,
  TrustLevel,
  UpdateWorkingStateResponse,
  WorkingStateUpdate,
  Writer,
} from './types.js';

/**
 * JSON with every object's keys sorted by UTF-16 code units, as RFC 8785 and the server's
 * payloads have them. JSON.stringify keeps insertion order, except that it puts
 * integer-like keys (a schema property "10") first in numeric order: re-serializing a
 * payload so changed bytes the parts never touched, and with them the provider's cache.
 */
function canonicalJson(value: unknown): string {
  // First as JSON.stringify reads it (toJSON, functions and undefined dropped, holes as
  // null), then every object's keys sorted.
  return sorted(JSON.parse(JSON.stringify(value)) as unknown);
}

function sorted(value: unknown): string {
  if (Array.isArray(value)) return `[${value.map(sorted).join(',')}]`;
  if (value !== null && typeof value === 'object') {
    const object = value as Record<string, unknown>;
    const entries = Object.keys(object)
      .sort()
      .map((k) => `${JSON.stringify(k)}:${sorted(object[k])}`);
    return `{${entries.join(',')}}`;
  }
  return JSON.stringify(value);
}

export const SERVICE = 'context_engine.v1.ContextEngine';
const RETRY_BUFFER_BYTES = 16 * 1024 * 1024;

/** proto-loader options the generated types were made with (package.json "generate"). */
export const LOAD_OPTIONS: protoLoader.Options = {
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_DIR],
};

// Transparent retries of UNAVAILABLE only, for every method but Build: the wrapper's keyed
// writes carry an idempotency key (Rule 2); a raw `call` of a keyed write must set one
// itself. A Build whose answer was lost may have been recorded, and a resend records
// another request, which no usage is reported for (the tool loop does not build again
// after UNAVAILABLE): Build's own entry, which a method's name makes the one that applies,
// has no retry policy. DEADLINE_EXCEEDED is not retried: the caller's deadline is spent.
const SERVICE_CONFIG = JSON.stringify({
  methodConfig: [
    {
      name: [{ service: SERVICE }],
      retryPolicy: {
        maxAttempts: 4,
        initialBackoff: '0.1s',
        maxBackoff: '2s',
        backoffMultiplier: 2,
        retryableStatusCodes: ['UNAVAILABLE'],
      },
    },
    { name: [{ service: SERVICE, method: 'Build' }] },
  ],
});

let loaded: ProtoGrpcType | undefined;

/** The loaded package definition (proto/ is parsed once per process). */
export function protoPackage(): ProtoGrpcType {
  if (!loaded) {
    const definition = protoLoader.loadSync('context_engine/v1/context_engine.proto', LOAD_OPTIONS);
    loaded = grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
  }
  return loaded;
}

export interface ClientOptions {
  /** "host:port"; a sidecar listens on 127.0.0.1:50051. */
  target: string;
  /**
   * Sent on every request; with auth on it must match the authenticated identity, or be ''
   * (with a token or credentials) for the server to take the identity's.
   */
  tenantId: string;
  /**
   * Bearer token, sent as `authorization: Bearer <token>`: over plaintext (no
   * `credentials`, or `grpc.credentials.createInsecure()`) only to a loopback target (a
   * sidecar), unless `allowInsecureToken`.
   */
  token?: string;
  /** TLS or mTLS credentials; plaintext when absent (or createInsecure()). */
  credentials?: grpc.ChannelCredentials;
  /**
   * Per-call deadline in milliseconds (default 30 s; 0 or Infinity: none); `deadlineMs`
   * overrides it per call.
   */
  timeoutMs?: number;
  /** Channel options, over the client's own where they name the same one. */
  channelOptions?: grpc.ChannelOptions;
  /** Send `token` in clear to a target that is not loopback (a network you trust). */
  allowInsecureToken?: boolean;
}

// What an HTTP/2 header value (gRPC metadata) may hold.
const HEADER_VALUE = /^[\x20-\x7e]+$/;

/**
 * Whether a gRPC target names this host: a loopback address, localhost, or a Unix socket;
 * for an ipv4:/ipv6: list, every address. A name is not (it may resolve elsewhere). The
 * engine's `context-engine explain` and the Python client apply the same rule.
 */
export function isLoopback(target: string): boolean {
  if (target.startsWith('unix:') || target.startsWith('unix-abstract:')) return true;
  for (const scheme of ['ipv4:', 'ipv6:']) {
    if (target.startsWith(scheme)) {
      return target.slice(scheme.length).split(',').every(oneLoopback);
    }
  }
  for (const scheme of ['dns:///', 'dns:']) {
    if (target.startsWith(scheme)) target = target.slice(scheme.length);
  }
  return oneLoopback(target);
}

// Loopback addresses: 127.0.0.0/8 and ::1, and an IPv4-mapped ::ffff:127.x (BlockList
// checks a mapped address against the IPv4 rules), as the Python and Go clients see them.
const LOOPBACK = new net.BlockList();
LOOPBACK.addSubnet('127.0.0.0', 8, 'ipv4');
LOOPBACK.addAddress('::1', 'ipv6');

function oneLoopback(target: string): boolean {
  let host = target.split(':').length === 2 ? target.slice(0, target.lastIndexOf(':')) : target;
  if (host.startsWith('[')) host = host.slice(1).split(']')[0];
  if (host.toLowerCase() === 'localhost') return true;
  const family = net.isIP(host);
  return family !== 0 && LOOPBACK.check(host, family === 4 ? 'ipv4' : 'ipv6');
}

/** Options every call takes. */
export interface CallOptions {
  /**
   * This call's deadline, in milliseconds from now; absent or 0: the client's `timeoutMs`.
   * Negative or NaN: the call rejects with a TypeError, as `timeoutMs` does.
   */
  deadlineMs?: number;
}

// The generated client's last overload of each method is (request, callback); inference
// from an overloaded method uses that one, which is all these need.
type ReqOf<M> = M extends (request: infer Req, callback: grpc.requestCallback<any>) => unknown
  ? Req
  : never;
type ResOf<M> = M extends (request: any, callback: grpc.requestCallback<infer Res>) => unknown
  ? Res
  : never;
/** The engine's unary RPCs by name (PascalCase, as in the proto). */
export type MethodName =
  | 'Plan'
  | 'GetPlan'
  | 'Rotate'
  | 'StartRun'
  | 'AppendItems'
  | 'Build'
  | 'GetBuild'
  | 'ReportUsage'
  | 'LoadSkill'
  | 'EraseSubject'
  | 'UpdateWorkingState'
  | 'ListControlTools'
  | 'PrepareCompaction'
  | 'CommitCompaction'
  | 'OfferFactCandidates';
export type RequestOf<K extends MethodName> = ReqOf<RawContextEngineClient[K]>;
export type ResponseOf<K extends MethodName> = ResOf<RawContextEngineClient[K]>;

const newKey = (): string => randomUUID();

/** The later version a CHECKPOINT_VERSION_CONFLICT names than `request` expected, if any. */
function movedOn(error: unknown, request: AppendItemsRequest): number | undefined {
  if (!(error instanceof ContextEngineError) || error.reason !== 'CHECKPOINT_VERSION_CONFLICT') {
    return undefined;
  }
  const latest = Number(error.metadata.latest_version ?? '');
  const expected = Number(request.expected_checkpoint_version ?? 0);
  return Number.isSafeInteger(latest) && latest > expected ? latest : undefined;
}

/**
 * The call ids the run has used that its build shows (the engine refuses a call id used
 * before in the run; one a compaction took out of the request is not seen here).
 */
function runCallIds(built: BuildResult, runId: string): Set<string> {
  const ids = new Set<string>();
  for (const message of built.response.request?.messages ?? []) {
    for (const block of message.blocks ?? []) {
      const paired =
        block.kind === 'tool_call'
          ? block.tool_call
          : block.kind === 'tool_result'
            ? block.tool_result
            : undefined;
      if (paired && block.run_id === runId) ids.add(paired.call_id);
    }
  }
  return ids;
}

/**
 * Why the engine would refuse to log the model's turn whatever its tools return
 * (AppendItems' INVALID_FIELD), or '': a call whose callId is empty, longer than
 * MAX_ID_CHARS, repeated in the turn or already used in the run (`used`), or that names no
 * tool; a reasoning item the engine cannot replay. The results of a turn with one could
 * never be logged: its tools are not run.
 */
function unloggable(turn: ModelTurn, used: Set<string>): string {
  const ids = new Set<string>();
  for (const [n, call] of (turn.toolCalls ?? []).entries()) {
    const at = `tool call ${n} (${JSON.stringify(call.name)})`;
    const callId = call.callId ?? '';
    const chars = Array.from(callId);
    const shown = JSON.stringify(chars.length <= 40 ? callId : chars.slice(0, 40).join('') + '…');
    if (!callId) return `${at} has no call_id`;
    if (chars.length > MAX_ID_CHARS) {
      return `${at} has a call_id longer than ${MAX_ID_CHARS} characters`;
    }
    if (ids.has(callId)) return `${at} has the call_id ${shown} of another call of the turn`;
    if (used.has(callId)) return `${at} has the call_id ${shown} of an earlier call of the run`;
    if (!call.name) return `tool call ${n} names no tool`;
    ids.add(callId);
  }
  for (const [n, item] of (turn.reasoning ?? []).entries()) {
    const problem = reasoningProblem(item.provider, item.opaque);
    if (problem) return `reasoning item ${n} ${problem}`;
  }
  return '';
}

/**
 * `turn` without the provider item ids the engine would refuse (over MAX_ID_CHARS,
 * whitespace, a control character), the text's and each call's. They only pair a replayed
 * reasoning item with the item after it, and the engine logs an item without one (it then
 * replays no reasoning before it); sent, the step's append was refused after its tools had
 * run (an audit). The model cannot correct them (the provider makes them).
 */
function withoutBadItemIds(turn: ModelTurn): ModelTurn {
  return {
    ...turn,
    textItemId: itemIdProblem(turn.textItemId ?? '') ? '' : turn.textItemId,
    toolCalls: turn.toolCalls?.map((c) =>
      itemIdProblem(c.providerItemId ?? '') ? { ...c, providerItemId: '' } : c,
    ),
  };
}

const UNKNOWN_TASK = /^items\[(\d+)\]\.tool_call\.task_id$/;

/**
 * The index of the item whose task_id the engine refused (a task the run's working state
 * does not hold), or undefined for any other error.
 */
function unknownTask(error: unknown, request: AppendItemsRequest): number | undefined {
  if (!(error instanceof ContextEngineError) || error.reason !== 'INVALID_FIELD') return undefined;
  const found = UNKNOWN_TASK.exec(error.field ?? '');
  if (!found) return undefined;
  const index = Number(found[1]);
  return request.items?.[index]?.tool_call?.task_id ? index : undefined;
}

// A tool loop step's append, resent by the loop itself while the engine cannot be reached:
// the channel's own retries cover UNAVAILABLE only, never DEADLINE_EXCEEDED. Attempts, not
// resends: the first send and 2 resends. A resend after DEADLINE_EXCEEDED gets twice the
// deadline the attempt before it had (docs/api.md: retry with a longer deadline).
const APPEND_ATTEMPTS = 3;
const APPEND_BACKOFF_MS = 200;
// Refusals of a Build that recorded nothing: the tool loop builds once more (buildStep).
const BUILD_AGAIN = new Set(['SESSION_BUSY', 'EPOCH_CONFLICT', 'SHUTTING_DOWN']);
/** The engine's control tools (ListControlTools), whose calls toolLoop relays itself. */
export const CONTROL_TOOL_NAMES: ReadonlySet<string> = new Set(['context.update_working_state']);
// Refusals of a control call's arguments the model can act on: relayed to it as the call's
// error result (applyControlCall), not thrown.
const MODEL_CORRECTS = new Set(['INVALID_FIELD', 'CONSTRAINT_PROTECTED', 'WORKING_STATE_CAP']);
const STATE_MOVED =
  'Not applied: the run moved on while you decided (another write landed first). The next ' +
  'request shows the run as it is now; call again if the update still applies.';
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** Longest tool name the providers accept (OpenAI's 64; Anthropic allows 128). */
export const MAX_WIRE_NAME = 64;

/**
 * The name a provider sees for a tool: providers accept [A-Za-z0-9_-] only, so the engine
 * sends "web.fetch" as "web-fetch". Map a model's answer back with BuildResult.toolName.
 */
export function wireToolName(name: string): string {
  // Per code point, like the server (a character outside the BMP is one "-", not two).
  const replaced = name.replace(/[^A-Za-z0-9_-]/gu, '-');
  return Array.from(replaced).slice(0, MAX_WIRE_NAME).join('') || '-';
}

// A deadline in milliseconds: 0 (none), more, or Infinity (none); NaN or negative is not.
const validMs = (ms: number): boolean => !Number.isNaN(ms) && ms >= 0;

function timestamp(date: Date): { seconds: number; nanos: number } {
  const ms = date.getTime();
  const seconds = Math.floor(ms / 1000);
  return { seconds, nanos: (ms - seconds * 1000) * 1_000_000 };
}

export class ContextEngineClient {
  readonly tenantId: string;
  readonly raw: RawContextEngineClient;
  /** Each call's deadline in milliseconds, unless the call gives its own `deadlineMs`. */
  readonly timeoutMs: number;
  private readonly token?: string;

  constructor(options: ClientOptions) {
    if (!options.tenantId && !options.token && !options.credentials) {
      // Without credentials the server has no identity to take the tenant from.
      throw new TypeError('tenantId is required without a token or credentials');
    }
    if (options.token !== undefined && !HEADER_VALUE.test(options.token)) {
      // Refused here: grpc-js threw its own error at the first call, synchronously.
      throw new TypeError('token is not a header value (printable ASCII, no line ending)');
    }
    // Explicitly insecure credentials are plaintext too: they sent the token in clear to
    // any target (an audit).
    const plaintext = !options.credentials?._isSecure();
    if (
      options.token &&
      plaintext &&
      !options.allowInsecureToken &&
      !isLoopback(options.target)
    ) {
      throw new TypeError(
        `token would cross the network in clear to ${options.target}: give credentials (TLS),` +
          ' use a loopback target, or pass allowInsecureToken: true',
      );
    }
    const timeoutMs = options.timeoutMs ?? 30_000;
    if (!validMs(timeoutMs)) throw new TypeError('timeoutMs must be 0 (no deadline) or more');
    this.tenantId = options.tenantId;
    this.token = options.token;
    this.timeoutMs = timeoutMs;
    const Stub = protoPackage().context_engine.v1.ContextEngine;
    this.raw = new Stub(options.target, options.credentials ?? grpc.credentials.createInsecure(), {
      'grpc.service_config': SERVICE_CONFIG,
      // A Build for a long-window model can exceed gRPC's 4 MiB receive default, and the
      // server does not cap what it sends (docs/operations.md, Request size).
      'grpc.max_receive_message_length': -1,
      // A call is resent only while its request fits the retry buffer (1 MiB per call by
      // default in grpc-js): room for the server's largest default request (4 MiB).
      'grpc.per_rpc_retry_buffer_size': RETRY_BUFFER_BYTES,
      'grpc.retry_buffer_size': 4 * RETRY_BUFFER_BYTES,
      ...options.channelOptions,
    });
  }

  close(): void {
    this.raw.close();
  }

  /**
   * Call one unary RPC by name with this client's metadata, deadline (or `deadlineMs`,
   * this call's) and typed errors.
   */
  call<K extends MethodName>(
    method: K,
    request: RequestOf<K>,
    opts: CallOptions = {},
  ): Promise<ResponseOf<K>> {
    if (typeof request !== 'object' || request === null || Array.isArray(request)) {
      // Sent, grpc-js encoded nothing, and the answer's callback threw where no caller
      // could catch it (run.resendAppend(undefined) crashed the process: an audit).
      return Promise.reject(new TypeError(`${method}: request must be an object (not sent)`));
    }
    const unknown = unknownEnumValue(method, request);
    if (unknown) {
      // Refused here, as the server refuses a bad field: sent, it would go as 0.
      const [field, description] = unknown;
      return Promise.reject(
        new InvalidArgumentError(
          grpc.status.INVALID_ARGUMENT,
          `${field}: ${description} (not sent)`,
          'INVALID_FIELD',
          '',
          {},
          [{ field, description }],
        ),
      );
    }
    if (opts.deadlineMs !== undefined && !validMs(opts.deadlineMs)) {
      // Refused as the client's timeoutMs is: a negative one was a deadline already past.
      return Promise.reject(new TypeError('deadlineMs must be 0 (no deadline) or more'));
    }
    const metadata = new grpc.Metadata();
    if (this.token) metadata.set('authorization', `Bearer ${this.token}`);
    // 0 is no deadline of the call's own, as absent is (never an expired one); the client's
    // 0 or Infinity is none at all (it was a deadline already past: an audit).
    const ms = opts.deadlineMs || this.timeoutMs;
    const deadline = ms && Number.isFinite(ms) ? new Date(Date.now() + ms) : Infinity;
    const rpc = this.raw[method] as unknown as (
      request: RequestOf<K>,
      metadata: grpc.Metadata,
      options: grpc.CallOptions,
      callback: grpc.requestCallback<ResponseOf<K>>,
    ) => grpc.ClientUnaryCall;
    return new Promise((resolve, reject) => {
      try {
        rpc.call(this.raw, request, metadata, { deadline }, (error, response) => {
          if (!error) return resolve(response as ResponseOf<K>);
          const typed = fromServiceError(error);
          // The key a wrapper made for this write, for a resend that must reuse it.
          const key = (request as { idempotency_key?: unknown }).idempotency_key;
          typed.idempotencyKey = typeof key === 'string' ? key : '';
          reject(typed);
        });
      } catch (error) {
        // grpc-js throws before sending on a closed channel: a ClientError, as Python's
        // client raises, not a plain Error (a review).
        reject(new ClientError(`${method}: ${(error as Error).message}`));
      }
    });
  }

  /** Plan a session (epoch 1), or return an existing session's current plan. */
  async openSession(
    spec: PlanSpec,
    opts: { sessionId?: string } & CallOptions = {},
  ): Promise<Session> {
    // '' too, as in Python: the engine would refuse an empty id after the round trip.
    const sessionId = opts.sessionId || newKey();
    let response;
    try {
      response = await this.call(
        'Plan',
        { tenant_id: this.tenantId, session_id: sessionId, spec },
        opts,
      );
    } catch (error) {
      // Plan is made safe to resend by its session id, not a key: a timed-out Plan may
      // have landed, and openSession(spec, { sessionId: error.sessionId }) finds it where
      // a new id would open a second session.
      if (error instanceof ContextEngineError) error.sessionId = sessionId;
      throw error;
    }
    return new Session(
      this,
      sessionId,
      response.plan!,
      response.created,
      response.spec_matches,
      response.unknown_tool_names,
    );
  }

  /**
   * Attach to an existing session. Its `plan` is the current plan, whatever `epoch` says:
   * it is the next rotate's `from_epoch`, and an older epoch's made that rotate fail
   * EPOCH_CONFLICT. With `epoch`, that epoch's plan is read too, as `requestedPlan` (a
   * second GetPlan).
   */
  async session(sessionId: string, epoch = 0, opts: CallOptions = {}): Promise<Session> {
    const read = { tenant_id: this.tenantId, session_id: sessionId };
    const current = await this.call('GetPlan', { ...read, epoch: 0 }, opts);
    const session = new Session(this, sessionId, current.plan!, false, true);
    if (epoch) session.requestedPlan = await session.refreshPlan(epoch, opts);
    return session;
  }

  /**
   * Report a model response's actual usage for the request Build recorded. `modelId` is
   * the model that answered (the provider response's `model`).
   */
  reportUsage(
    sessionId: string,
    requestSequence: number,
    modelId: string,
    usage: Usage,
    idempotencyKey?: string,
    opts: CallOptions = {},
  ): Promise<ReportUsageResponse> {
    return this.call(
      'ReportUsage',
      {
        tenant_id: this.tenantId,
        session_id: sessionId,
        request_sequence: requestSequence,
        model_id: modelId,
        input_tokens: usage.inputTokens,
        output_tokens: usage.outputTokens ?? 0,
        cache_read_input_tokens: usage.cacheReadInputTokens ?? 0,
        cache_creation_input_tokens: usage.cacheCreationInputTokens ?? 0,
        idempotency_key: idempotencyKey ?? `usage:${sessionId}:${requestSequence}`,
      },
      opts,
    );
  }

  /** Rebuild a recorded request byte for byte (GetBuild), by its request_sequence. */
  async getBuild(
    sessionId: string,
    requestSequence: number,
    opts: CallOptions = {},
  ): Promise<BuildResult> {
    const response = await this.call(
      'GetBuild',
      { tenant_id: this.tenantId, session_id: sessionId, request_sequence: requestSequence },
      opts,
    );
    return new BuildResult(response);
  }

  /**
   * Erase a person's memories from every snapshot and recorded request of the tenant. Safe
   * to resend: the answer is everything erasing them has done, as first reported.
   */
  eraseSubject(personId: string, opts: CallOptions = {}): Promise<EraseSubjectResponse> {
    return this.call('EraseSubject', { tenant_id: this.tenantId, person_id: personId }, opts);
  }

  /** The engine's control tools (context.update_working_state), for a PlanSpec's tools. */
  async listControlTools(opts: CallOptions = {}): Promise<ToolSpecOutput[]> {
    return (await this.call('ListControlTools', {}, opts)).tools;
  }
}

/** The list a payload path such as "messages[2].content[1]" ends in, and the index. */
function contentList(body: unknown, path: string): [unknown[], number] {
  const steps = [...path.matchAll(/(\w+)\[(\d+)\]/g)].map((m) => [m[1], Number(m[2])] as const);
  if (steps.length === 0) throw new Error(`not a payload path: ${path}`);
  let value = body as Record<string, unknown[]>;
  for (const [name, index] of steps.slice(0, -1)) {
    value = value[name][index] as Record<string, unknown[]>;
  }
  const [name, index] = steps[steps.length - 1];
  return [value[name], index];
}

/** One Build: the request to send and how it was made. */
export class BuildResult {
  constructor(readonly response: BuildResponse) {}

  /**
   * JSON bytes ready to POST to the provider named by providerApi; a user message's
   * attachments are not in them: add them as attachmentPlacements says (docs/api.md).
   */
  get providerPayload(): Buffer {
    return this.response.provider_payload;
  }
  /**
   * Per user message with attachments, in payload order: the JSON path of the part holding
   * its text (insert its attachment parts just before it, last placement first) and, per
   * attachment, whether to send its content or its marker. Empty when none has any.
   */
  get attachmentPlacements(): AttachmentPlacement[] {
    return this.response.attachment_placements;
  }
  /**
   * providerPayload with every message's attachments added where attachmentPlacements
   * says. `part(send)` is the provider's content part (or parts) for one attachment: its
   * content when `send.content`, its marker otherwise; you resolve `send.attachment.ref`.
   * The parts go just before the part each placement names, last placement first; the
   * result is serialized as the server serializes (RFC 8785: keys sorted), so what the
   * parts leave alone keeps its bytes and the same response and parts give the same bytes
   * on every request. The payload unchanged when no message has attachments.
   */
  payloadWithAttachments(
    part: (send: AttachmentPlacement['attachments'][number]) => object | object[],
  ): Buffer {
    const placements = this.response.attachment_placements;
    if (placements.length === 0) return this.providerPayload;
    const body = this.payload();
    for (const placement of [...placements].reverse()) {
      const parts = placement.attachments.flatMap((send) => part(send));
      const [holder, index] = contentList(body, placement.payload_path);
      holder.splice(index, 0, ...parts);
    }
    return Buffer.from(canonicalJson(body), 'utf8');
  }
  /** "anthropic.messages" or "openai.responses". */
  get providerApi(): string {
    return this.response.provider_api;
  }
  get prefixSha256(): string {
    return this.response.prefix_sha256;
  }
  get requestSha256(): string {
    return this.response.request_sha256;
  }
  /** True when no request was built: compact, then build again. */
  get needsCompaction(): boolean {
    return this.response.needs_compaction;
  }
  /** The model.request.started event; pass it to reportUsage. */
  get requestSequence(): number {
    return this.response.request_sequence;
  }
  get checkpointVersion(): number {
    return this.response.checkpoint_version;
  }
  get epoch(): number {
    return this.response.epoch;
  }
  /** The provider-neutral request (blocks tagged with row and trust). */
  get request(): ModelRequest | null {
    return this.response.request;
  }
  get pressure(): PressureReport | null {
    return this.response.pressure;
  }
  /** providerPayload decoded from JSON. */
  payload(): unknown {
    return JSON.parse(this.providerPayload.toString('utf8'));
  }
  /** The tool behind a name the model used ("web-fetch" -> "web.fetch"); else unchanged. */
  toolName(wireName: string): string {
    const tool = this.request?.tools.find((t) => wireToolName(t.name) === wireName);
    return tool?.name ?? wireName;
  }
  /** Whether the request defines the tool `name` (not the wire name) for the model. */
  offers(name: string): boolean {
    return this.request?.tools.some((t) => t.name === name) ?? false;
  }
}

/**
 * A planned session. `plan` is the session's current plan as the last call that returned
 * one found it (the next rotate's `from_epoch`): neither a child run's rotated plan (its
 * parent's lineage continued) nor an older epoch's plan read with `refreshPlan(epoch)`
 * is taken as it.
 */
export class Session {
  /** The plan of the epoch `engine.session(id, epoch)` asked for; the first plan read otherwise. */
  requestedPlan: ContextPlan;

  constructor(
    readonly client: ContextEngineClient,
    readonly sessionId: string,
    public plan: ContextPlan,
    readonly created: boolean,
    readonly specMatches: boolean,
    /** Names the spec's agent enables or defers that no tool of it defines (typos); a
     * rotate sets them from its plan's spec. */
    public unknownToolNames: string[] = [],
  ) {
    this.requestedPlan = plan;
  }

  get tenantId(): string {
    return this.client.tenantId;
  }

  /**
   * Start a top-level run (one turn) seeded by the user's message, with the references of
   * any files it attaches (Build costs them; BuildResult.attachmentPlacements says where
   * the adapter adds them and what it sends).
   */
  startRun(
    text: string,
    opts: {
      runId?: string;
      admission?: RunAdmission;
      idempotencyKey?: string;
      attachments?: Attachment[];
    } & CallOptions = {},
  ): Promise<Run> {
    const message = { text, attachments: opts.attachments ?? [] };
    return this.start({ user_message: message, admission: opts.admission ?? null }, opts);
  }

  /**
   * Start a child run of `parentRunId`: seeded by the parent's instruction, which its
   * Build shows as the model's words (delegated), not the user's.
   */
  startChildRun(
    parentRunId: string,
    instruction: string,
    opts: { runId?: string; idempotencyKey?: string } & CallOptions = {},
  ): Promise<Run> {
    return this.start({ child: { parent_run_id: parentRunId, instruction } }, opts);
  }

  private async start(
    seed: Pick<RequestOf<'StartRun'>, 'user_message' | 'child' | 'admission'>,
    opts: { runId?: string; idempotencyKey?: string } & CallOptions,
  ): Promise<Run> {
    const response = await this.client.call(
      'StartRun',
      {
        tenant_id: this.tenantId,
        session_id: this.sessionId,
        run_id: opts.runId ?? '',
        idempotency_key: opts.idempotencyKey ?? newKey(),
        ...seed,
      },
      opts,
    );
    // A top-level run's rotated_plan is the session's current plan; a child's is its
    // parent's lineage continued, which need not be (docs/api.md, StartRun).
    // A resend replays the first answer, whose plan may since have been rotated past:
    // never step back to an older epoch.
    const rotated = response.rotated_plan;
    if (rotated && !response.run!.parent_run_id && rotated.epoch > this.plan.epoch) {
      this.plan = rotated;
    }
    return new Run(
      this,
      response.run!.run_id,
      response.checkpoint_version,
      response.run!.epoch,
      response.run!.seed_event_sequence,
    );
  }

  /**
   * Load a pinned catalog skill's body into Region B: sticky, at most two. Loading it
   * again with the same body answers newly_loaded=false; another body rejects
   * (FailedPreconditionError, SKILL_ALREADY_LOADED).
   */
  loadSkill(
    name: string,
    body: string,
    opts: { trust?: TrustLevel; runId?: string } & CallOptions = {},
  ): Promise<LoadSkillResponse> {
    return this.client.call(
      'LoadSkill',
      {
        tenant_id: this.tenantId,
        session_id: this.sessionId,
        name,
        body,
        trust: opts.trust ?? 'TRUST_LEVEL_UNSPECIFIED',
        run_id: opts.runId ?? '',
      },
      opts,
    );
  }

  /** Attach to an existing run at a known checkpoint version (no RPC). */
  run(runId: string, checkpointVersion: number): Run {
    return new Run(this, runId, checkpointVersion, this.plan.epoch);
  }

  /**
   * Re-read the current plan, which becomes `plan`; or read a given epoch's, which leaves
   * `plan` as it is.
   */
  async refreshPlan(epoch = 0, opts: CallOptions = {}): Promise<ContextPlan> {
    const response = await this.client.call(
      'GetPlan',
      { tenant_id: this.tenantId, session_id: this.sessionId, epoch },
      opts,
    );
    if (epoch === 0) this.plan = response.plan!;
    return response.plan!;
  }

  /**
   * Start a new prefix epoch from the current one. A lost race rejects with AbortedError.
   *
   * The idempotency key makes a resend of a rotation that landed answer with its plan
   * instead of EPOCH_CONFLICT (the channel's own retries reuse it). To retry by hand after
   * UnavailableError or DEADLINE_EXCEEDED, call again with the first attempt's key and the
   * same reason, spec and detail: a failed rotate leaves `plan` as it was.
   */
  async rotate(
    reason: PlanReason,
    opts: { spec?: PlanSpec; detail?: string; idempotencyKey?: string } & CallOptions = {},
  ): Promise<ContextPlan> {
    const response = await this.client.call(
      'Rotate',
      {
        tenant_id: this.tenantId,
        session_id: this.sessionId,
        from_epoch: this.plan.epoch,
        reason,
        spec: opts.spec ?? null,
        detail: opts.detail ?? '',
        idempotency_key: opts.idempotencyKey ?? newKey(),
      },
      opts,
    );
    this.plan = response.plan!;
    // The server checks a spec sent; without one, the pinned spec's names stand.
    if (opts.spec) this.unknownToolNames = response.unknown_tool_names;
    return this.plan;
  }

  /** Offer the session's trusted facts to memory formation (at the session's end). */
  offerFactCandidates(
    opts: { idempotencyKey?: string } & CallOptions = {},
  ): Promise<OfferFactCandidatesResponse> {
    return this.client.call(
      'OfferFactCandidates',
      {
        tenant_id: this.tenantId,
        session_id: this.sessionId,
        idempotency_key: opts.idempotencyKey ?? newKey(),
      },
      opts,
    );
  }

  /**
   * Report the usage of the response to `build`'s request. `opts.model`: the model that
   * answered, the provider response's `model` (ModelTurn.model); absent, the one the
   * request was built for. The engine records a report of another model but learns nothing
   * from it, so naming the planned model for it would skew the estimator.
   */
  reportUsage(
    build: BuildResult,
    usage: Usage,
    idempotencyKey?: string,
    opts: ReportUsageOptions = {},
  ): Promise<ReportUsageResponse> {
    const modelId = opts.model || build.request?.model_id || this.plan.model_id;
    return this.client.reportUsage(
      this.sessionId,
      build.requestSequence,
      modelId,
      usage,
      idempotencyKey,
      opts,
    );
  }
}

export interface ReportUsageOptions extends CallOptions {
  /** The model that answered (the provider response's `model`); absent: the planned one. */
  model?: string;
}

export interface BuildOptions extends CallOptions {
  /** The clock row 14 renders; the server's clock when absent. */
  now?: Date;
  /** In-turn recall, corrections and knowledge passages. */
  step?: StepContext;
  /** Build from this version instead of the run's latest known one. */
  checkpointVersion?: number;
}

/**
 * A compaction summary and its token count. Without `tokens`, compact estimates it
 * conservatively (one token per three UTF-8 bytes, rounded up).
 */
export interface Summary {
  text: string;
  tokens?: number;
}

/** Writes the summary from the prepared input: its text, or a Summary with its count. */
export type Summarize = (prepared: PrepareCompactionResponse) => Promise<string | Summary>;

export interface CompactOptions extends CallOptions {
  /** Recorded with the summary (default '@context-engine/client@0.1.0'). */
  compactorVersion?: string;
  /**
   * CommitCompaction's key. A commit that failed UNAVAILABLE or DEADLINE_EXCEEDED may
   * still have landed: retry with the first attempt's key and a summarizer that returns
   * the same summary, from a Run at the version the first attempt compacted (a failed
   * commit leaves `checkpointVersion` as it was); a commit that landed answers then.
   */
  idempotencyKey?: string;
  /** The last event to compact (0, the default: the engine chooses the cut). */
  throughSequence?: number;
}

export interface ToolLoopOptions extends CallOptions {
  /** Send the build to the model; return what it said (`model`: the model that answered). */
  callModel: (build: BuildResult) => Promise<ModelTurn>;
  /** Run one tool call; a string is an EXTERNAL_UNTRUSTED result. */
  runTool: (call: ToolCallRequest) => Promise<ToolOutput | string>;
  /** A fixed clock or a function read before each build. */
  now?: Date | (() => Date);
  step?: StepContext;
  /** Writes the compaction summary when the body does not fit. */
  summarize?: Summarize;
  maxSteps?: number;
  /** Report each turn's usage (default true). */
  reportUsage?: boolean;
}

export interface ToolLoopResult {
  final: ModelTurn;
  builds: BuildResult[];
  /** One per model turn that reported usage. */
  reports: ReportUsageResponse[];
  /**
   * The reports that failed: each step's build, usage, the model that answered and the
   * error, the engine's (a ContextEngineError: `retryable` says whether a resend can
   * succeed) or the report's own (a usage the request cannot carry: a resend fails again).
   * Resend one with `session.reportUsage(build, usage, undefined, { model })`: its key is
   * the build's, so a report that landed with only its answer lost is not counted twice
   * (and the same key with another model is IDEMPOTENCY_KEY_REUSED).
   */
  unreported: { build: BuildResult; usage: Usage; model?: string; error: unknown }[];
}

export class Run {
  constructor(
    readonly session: Session,
    readonly runId: string,
    public checkpointVersion: number,
    /** The epoch the run's latest build was made against: StartRun's, then each Build's. */
    public epoch: number,
    /**
     * The session sequence of the run's seed event (its user message, for a top-level
     * run; as StartRun answered, unknown for a run resumed by id): cite it as a fact's
     * evidence for the fact to be the user's.
     */
    readonly seedEventSequence?: number,
  ) {}

  private get ids() {
    return {
      tenant_id: this.session.tenantId,
      session_id: this.session.sessionId,
      run_id: this.runId,
    };
  }

  private get client(): ContextEngineClient {
    return this.session.client;
  }

  /** Append items in order; tracks the new checkpoint version. */
  append(
    items: ConversationItem[],
    idempotencyKey?: string,
    opts: CallOptions = {},
  ): Promise<AppendItemsResponse> {
    return this.resendAppend(this.appendRequest(items, idempotencyKey), opts);
  }

  private appendRequest(items: ConversationItem[], idempotencyKey?: string): AppendItemsRequest {
    return {
      ...this.ids,
      expected_checkpoint_version: this.checkpointVersion,
      idempotency_key: idempotencyKey ?? newKey(),
      items,
    };
  }

  /**
   * Send an AppendItemsRequest as it is, such as a tool loop error's `pendingRequest`: its
   * key makes a resend of an append that landed answer with the first result instead of
   * writing it twice. Tracks the new checkpoint version.
   */
  async resendAppend(
    request: AppendItemsRequest,
    opts: CallOptions = {},
  ): Promise<AppendItemsResponse> {
    const response = await this.client.call('AppendItems', request, opts);
    // A resend of an append that landed long ago answers with its first (older) version:
    // never move back past what this run has seen since.
    this.checkpointVersion = Math.max(this.checkpointVersion, response.checkpoint_version);
    return response;
  }

  /**
   * A tool loop step's one append, sent up to APPEND_ATTEMPTS times as it is (same key,
   * same bytes) while it fails for want of the engine, with twice the deadline after a
   * DEADLINE_EXCEEDED: the step's tools have run, and losing their results would make the
   * caller run them again. Whatever error ends it (retryable or not: an expired token, a
   * proxy's INTERNAL, a cancellation), it carries the request (`pendingRequest`) for the
   * caller to resend.
   */
  private async appendStep(
    items: ConversationItem[],
    final: boolean,
    opts: CallOptions,
  ): Promise<void> {
    const request = this.appendRequest(items);
    try {
      await this.sendStep(request, opts.deadlineMs || this.client.timeoutMs, !final);
    } catch (error) {
      // Any error, not only ours (a ContextEngineError always has the field).
      if (typeof error === 'object' && error !== null) {
        try {
          (error as { pendingRequest?: AppendItemsRequest }).pendingRequest = request;
        } catch {
          // A frozen object: thrown as it is.
        }
      }
      throw error;
    }
  }

  /**
   * `rebase`: a step whose tools ran goes after a write that landed first; a final answer
   * does not (the tool loop asks the model again).
   */
  private async sendStep(
    request: AppendItemsRequest,
    deadlineMs: number,
    rebase: boolean,
  ): Promise<void> {
    let rebased = !rebase;
    for (let attempt = 1; ; attempt++) {
      try {
        await this.resendAppend(request, { deadlineMs });
        return;
      } catch (error) {
        const task = unknownTask(error, request);
        if (task !== undefined) {
          // A call's task_id names no task of the run's working state (which no RPC reads,
          // and a control call of the step may change): refused, the step's results were
          // lost after its tools ran (an audit). Nothing was written; the call is logged
          // without it, under the same key, and no task moves (none could). Not an
          // attempt: each call's goes once.
          request.items![task].tool_call!.task_id = '';
          attempt -= 1;
          continue;
        }
        const latest = rebased ? undefined : movedOn(error, request);
        if (latest !== undefined && attempt < APPEND_ATTEMPTS) {
          rebased = true;
          // Another write landed first (the user's next message, say): the step goes after
          // it, under the same key. Thrown, its tools' results were lost to a request that
          // could never be resent as it was (an audit).
          request.expected_checkpoint_version = latest;
          continue;
        }
        // Refused for what it says (a resend fails again), or the last attempt.
        if (!(error instanceof ContextEngineError) || !error.retryable) throw error;
        if (attempt === APPEND_ATTEMPTS) throw error;
        // It may have been too short for this append.
        if (error instanceof DeadlineExceededError) deadlineMs *= 2;
      }
      await sleep(APPEND_BACKOFF_MS * 2 ** (attempt - 1));
    }
  }

  /**
   * Assemble the next model request from this run's latest known checkpoint. `epoch`
   * becomes the build's: a rotation reaches a run at its next build.
   */
  async build(opts: BuildOptions = {}): Promise<BuildResult> {
    const response = await this.client.call(
      'Build',
      {
        ...this.ids,
        checkpoint_version: opts.checkpointVersion ?? this.checkpointVersion,
        now: opts.now ? timestamp(opts.now) : null,
        step: opts.step ?? null,
      },
      opts,
    );
    this.epoch = response.epoch || this.epoch;
    return new BuildResult(response);
  }

  /**
   * The context.update_working_state control tool's effect: a typed transition, written
   * by the model (default), the user or the runtime. Tracks the new checkpoint version.
   */
  async updateWorkingState(
    update: WorkingStateUpdate,
    opts: { writer?: Writer; idempotencyKey?: string } & CallOptions = {},
  ): Promise<UpdateWorkingStateResponse> {
    const response = await this.client.call(
      'UpdateWorkingState',
      {
        ...this.ids,
        expected_checkpoint_version: this.checkpointVersion,
        writer: opts.writer ?? 'WRITER_MODEL',
        update,
        idempotency_key: opts.idempotencyKey ?? newKey(),
      },
      opts,
    );
    // A resend under the same key replays its first answer: never move back.
    this.checkpointVersion = Math.max(this.checkpointVersion, response.checkpoint_version);
    return response;
  }

  /**
   * The model's context.update_working_state call, relayed as it came (UpdateWorkingState's
   * `tool_arguments_json`, as the model's write) under a key of the run and call id, so a
   * resend replays its first answer. Resolves to the call's result for the model: that the
   * state changed (the next request shows it), or, where the engine refuses the arguments
   * (INVALID_FIELD, CONSTRAINT_PROTECTED, WORKING_STATE_CAP), the refusal as an error result
   * the model can act on; either logged as untrusted content, in an envelope. Refused
   * because another write landed first (CHECKPOINT_VERSION_CONFLICT), it is not sent again
   * after that write, which the model decided without: the result says so, and the step's
   * append goes after that write as usual. Any other error rejects. toolLoop calls it for a
   * control tool's call where the build defines the tool (CONTROL_TOOL_NAMES).
   */
  async applyControlCall(toolCall: ToolCallRequest, opts: CallOptions = {}): Promise<ToolOutput> {
    const key = createHash('sha256').update(`${this.runId}\0${toolCall.callId}`).digest('hex');
    const source = `engine:${toolCall.name}`;
    const args = toolCall.arguments ?? {};
    const request = {
      ...this.ids,
      expected_checkpoint_version: this.checkpointVersion,
      writer: 'WRITER_MODEL' as const,
      tool_arguments_json: typeof args === 'string' ? args : JSON.stringify(args),
      idempotency_key: `control-${key}`.slice(0, 64),
    };
    let response: UpdateWorkingStateResponse;
    try {
      response = await this.client.call('UpdateWorkingState', request, opts);
    } catch (error) {
      if (!(error instanceof ContextEngineError)) throw error;
      // Another write landed first (the user's next message, say): the model decided
      // without it, so it is told, not overruled by a resend (a review).
      if (error.reason === 'CHECKPOINT_VERSION_CONFLICT') return { content: STATE_MOVED, isError: true, source };
      if (!MODEL_CORRECTS.has(error.reason)) throw error;
      // Untrusted, in an envelope: it quotes the model's words, and no fact may rest on
      // the engine's reply as trusted (a review).
      // The server's message, as the Python client relays it: the result is logged, and
      // the clients' requests for one step should be the same bytes (a review).
      // The field at fault where the message does not say it (which entry of a list: an
      // audit found "no such constraint" with no hint which of four).
      const field = error.field;
      const where = field && !error.statusMessage.includes(field) ? ` at ${field}` : '';
      return {
        content: `Not applied (${error.reason}${where}): ${error.statusMessage}`,
        isError: true,
        source,
      };
    }
    this.checkpointVersion = Math.max(this.checkpointVersion, response.checkpoint_version);
    return { content: 'Working state updated; the next request shows it.', source };
  }

  /** Session.reportUsage: `opts.model` is the model that answered (absent: the planned). */
  reportUsage(
    build: BuildResult,
    usage: Usage,
    idempotencyKey?: string,
    opts: ReportUsageOptions = {},
  ): Promise<ReportUsageResponse> {
    return this.session.reportUsage(build, usage, idempotencyKey, opts);
  }

  /**
   * PrepareCompaction -> the worker's summarizer -> CommitCompaction. Returns the new
   * checkpoint version. `opts` may also be the compactor version alone (as before). The
   * summary must count fewer tokens than what it replaces (`prepared.tokens_before`);
   * else INVALID_ARGUMENT, reason INVALID_FIELD naming `result.summary`: return a Summary
   * with its `tokens` when you know the count, else it is estimated conservatively.
   * `deadlineMs` is each of the two calls' deadline.
   */
  async compact(summarize: Summarize, opts: CompactOptions | string = {}): Promise<number> {
    const options: CompactOptions = typeof opts === 'string' ? { compactorVersion: opts } : opts;
    const prepared = await this.client.call(
      'PrepareCompaction',
      {
        ...this.ids,
        checkpoint_version: this.checkpointVersion,
        through_sequence: options.throughSequence ?? 0,
      },
      options,
    );
    const written = await summarize(prepared);
    const summary: Summary = typeof written === 'string' ? { text: written } : written;
    const response = await this.client.call(
      'CommitCompaction',
      {
        ...this.ids,
        expected_checkpoint_version: prepared.checkpoint_version,
        idempotency_key: options.idempotencyKey ?? newKey(),
        result: {
          summary: summary.text,
          source_event_ids: prepared.source_event_ids,
          elided: prepared.elided,
          replaced_through_sequence: prepared.replaced_through_sequence,
          depth: prepared.depth,
          tokens_before: prepared.tokens_before,
          // Conservative when the worker does not know: one token per three UTF-8 bytes.
          tokens_after: summary.tokens || Math.ceil(Buffer.byteLength(summary.text, 'utf8') / 3),
          compactor_version: options.compactorVersion ?? '@context-engine/client@0.1.0',
          prompt_version: prepared.prompt_version,
        },
      },
      options,
    );
    // A resend under the same key replays its first answer: never move back.
    this.checkpointVersion = Math.max(this.checkpointVersion, response.checkpoint_version);
    return this.checkpointVersion;
  }

  /**
   * Build -> model -> tools -> append -> usage, until the model answers without tool
   * calls. The model's items and the tool results go in one append per step, so the log
   * never holds a call without its result. `deadlineMs` is each RPC's deadline.
   *
   * The append is sent up to 3 times (the first send and 2 resends) as it is (same key,
   * same bytes) while it fails UNAVAILABLE or DEADLINE_EXCEEDED, each resend after a
   * DEADLINE_EXCEEDED with twice the deadline the attempt before it had: a resend of one
   * that landed answers with its first result. Any error that ends the append (one still
   * failing after the resends, or one never resent: UNAUTHENTICATED, INTERNAL, CANCELLED...)
   * is thrown with the request as `pendingRequest`, the model's turn as `turn` and whether
   * it was the final answer as `final`: resend it (`resendAppend`, once the cause is gone);
   * then, for a step with tool calls, call toolLoop again; for the final answer, stop:
   * `turn` is the answer (another toolLoop would ask the model again and log a second
   * one). Each step builds from the
   * run's latest checkpoint, so once a step's append is in the log (landed with its answer
   * lost, or resent), calling toolLoop again shows the model the results it has and runs
   * none of that step's tools again. A tool that throws ends the loop before the append:
   * the step's tools that ran are then not logged.
   *
   * Before any tool of a step runs, the model's turn is checked for what the engine would
   * refuse to log whatever the tools return. A call whose arguments it cannot log
   * (`argumentsProblem`) is logged with {} and answered with an error result the model can
   * correct, not run. A provider item id it refuses (`textItemId` or a call's
   * `providerItemId` over 200 characters, or holding whitespace or a control character) is
   * logged as none: it only pairs replayed reasoning, and the model cannot correct it. A
   * turn that cannot be logged at all throws a ClientError, with no tool run and the turn
   * as `turn` (its usage reported): a call whose `callId` is empty, over 200 characters,
   * repeated in the turn, or used by an earlier call of the run the build shows, or that
   * names no tool, or a reasoning item the engine cannot replay. Give each call an id
   * unique within the run (rewrite the provider's in callModel if it repeats them across
   * steps); calling toolLoop again asks the model again. A call's `taskId` the engine
   * refuses (no task of the run's working state has it, which only the append can tell) is
   * dropped and the step sent again under the same key: its results are logged, and no
   * task moves.
   *
   * Usage is reported after the append, under the model that answered (`turn.model`), and
   * a report that fails, for any reason, is kept in the result (`unreported`, with the
   * error: its `retryable` says whether a resend can succeed) rather than thrown: the
   * step's items are in the log, and throwing after the final answer was appended lost
   * that answer to the caller, whose second toolLoop asked the model again and appended a
   * second answer. A step ended by an error (its append failed, a tool threw) still reports
   * the model's usage, or keeps it in `unreported`: unsent, with the step's error, when
   * the engine was unreachable. Any error that ends the loop carries what it kept so far,
   * `unreported` and `builds`, as properties.
   *
   * An append refused CHECKPOINT_VERSION_CONFLICT because another write landed first (the
   * user's next message on the run, say) is resent once under the same key at the version
   * the error names: the step goes after that write, and its tools' results are not lost.
   * A final answer is not: it answered a log that has moved on, and appended after that
   * write it left the write (the user's next message) unanswered. Nothing of it is written;
   * its usage is reported, and the loop builds and asks the model again (a step of
   * `maxSteps`).
   */
  async toolLoop(opts: ToolLoopOptions): Promise<ToolLoopResult> {
    const builds: BuildResult[] = [];
    const reports: ReportUsageResponse[] = [];
    const unreported: ToolLoopResult['unreported'] = [];
    try {
      return await this.loop(opts, builds, reports, unreported);
    } catch (error) {
      // What the loop kept, for the caller to resend (reports) or inspect: thrown without
      // it, a failed report of an earlier step was lost (an audit).
      if (typeof error === 'object' && error !== null) {
        try {
          Object.assign(error, { unreported, builds });
        } catch {
          // A frozen object: thrown as it is.
        }
      }
      throw error;
    }
  }

  /**
   * A tool loop's Build, built again once after a refusal that recorded nothing
   * (BUILD_AGAIN): ABORTED EPOCH_CONFLICT (an erasure invalidated the plan meanwhile:
   * docs/api.md says build again), SESSION_BUSY, or UNAVAILABLE SHUTTING_DOWN (a draining
   * replica refused it before its handler ran; the channel does not resend a Build). Each
   * ended the loop though nothing was lost (an audit). Not after any other UNAVAILABLE or
   * DEADLINE_EXCEEDED: that Build may have been recorded, and another would leave it a
   * request no usage is reported for (a review).
   */
  private async buildStep(opts: BuildOptions): Promise<BuildResult> {
    try {
      return await this.build(opts);
    } catch (error) {
      if (!(error instanceof ContextEngineError) || !BUILD_AGAIN.has(error.reason)) throw error;
      await sleep(APPEND_BACKOFF_MS);
    }
    return this.build(opts);
  }

  private async loop(
    opts: ToolLoopOptions,
    builds: BuildResult[],
    reports: ReportUsageResponse[],
    unreported: ToolLoopResult['unreported'],
  ): Promise<ToolLoopResult> {
    const maxSteps = opts.maxSteps ?? 16;
    const call: CallOptions = { deadlineMs: opts.deadlineMs };
    let compactions = 0;
    while (builds.length < maxSteps) {
      const now = typeof opts.now === 'function' ? opts.now() : opts.now;
      const built = await this.buildStep({ ...call, now, step: opts.step, checkpointVersion: 0 });
      this.checkpointVersion = built.response.checkpoint_version || this.checkpointVersion;
      if (built.needsCompaction) {
        // The server caps summary depth at 2; a third attempt would fail there.
        if (!opts.summarize || compactions >= 2) throw new NeedsCompactionError(built);
        await this.compact(opts.summarize, call);
        compactions += 1;
        continue;
      }
      builds.push(built);
      const answered = await opts.callModel(built);
      // Tool calls arrive under the provider's wire names; log and run the real ones.
      // Arguments the engine cannot log (cut off, not an object, a 64-bit integer) would
      // fail the step's append after its tools ran, and a retry would run them again (a
      // review): such a call is logged with none and answered, not run.
      const problems = (answered.toolCalls ?? []).map((c) => argumentsProblem(c.arguments));
      const turn: ModelTurn = withoutBadItemIds({
        ...answered,
        toolCalls: answered.toolCalls?.map((c, n) => ({
          ...c,
          name: built.toolName(c.name),
          arguments: problems[n] ? {} : c.arguments,
        })),
      });
      const final = !turn.toolCalls?.length;
      try {
        // A turn the engine would refuse to log whatever its tools return (a call id it
        // cannot take, a reasoning item it cannot replay) ran its tools, then failed its
        // append for good: the results were lost, and the next toolLoop ran the tools
        // again (an audit). Nothing runs; the error carries the turn.
        const refused = unloggable(turn, runCallIds(built, this.runId));
        if (refused) {
          throw new ClientError(`the model's turn cannot be logged: ${refused}; no tool was run`);
        }
        const items = turnItems(turn);
        for (const [n, toolCall] of (turn.toolCalls ?? []).entries()) {
          // The engine's own tools are the engine's to run (applyControlCall).
          // Where the build offered the tool: a call of a tool the model was not given is
          // its runTool's to refuse (a review: an injected objective was applied).
          const output: ToolOutput | string = problems[n]
            ? {
                content: `Not run: the call's arguments ${problems[n]}; call it again with a JSON object.`,
                isError: true,
              }
            : CONTROL_TOOL_NAMES.has(toolCall.name) && built.offers(toolCall.name)
              ? await this.applyControlCall(toolCall, call)
              : await opts.runTool(toolCall);
          items.push(resultItem(toolCall, output));
        }
        if (items.length) await this.appendStep(items, final, call);
      } catch (error) {
        const pending = (error as { pendingRequest?: AppendItemsRequest } | null)?.pendingRequest;
        if (final && pending && movedOn(error, pending) !== undefined) {
          // The answer was to a log another write has since moved on (the user's next
          // message, say): appended after it, that message went unanswered (an audit).
          // Nothing of the step is written; the model is asked again.
          await this.report(built, turn, undefined, opts, call, reports, unreported);
          continue;
        }
        // The model's tokens were spent, whatever ended the step: its usage is reported,
        // or kept (an audit: it was lost).
        await this.report(built, turn, error, opts, call, reports, unreported);
        if (typeof error === 'object' && error !== null) {
          try {
            Object.assign(error, { turn, final });
          } catch {
            // A frozen object: thrown as it is.
          }
        }
        throw error;
      }
      await this.report(built, turn, undefined, opts, call, reports, unreported);
      if (final) return { final: turn, builds, reports, unreported };
    }
    throw new ToolLoopLimitError(maxSteps);
  }

  /**
   * Report the step's usage; a report that fails is kept, never thrown: the step may be in
   * the log, and throwing after the final answer was appended lost that answer (an audit:
   * a refused report did so; a review: so did a usage the request cannot carry). After a
   * step that `failed` with the engine unreachable it is kept unsent, with that error.
   */
  private async report(
    built: BuildResult,
    turn: ModelTurn,
    failed: unknown,
    opts: ToolLoopOptions,
    call: CallOptions,
    reports: ReportUsageResponse[],
    unreported: ToolLoopResult['unreported'],
  ): Promise<void> {
    if (!(opts.reportUsage ?? true) || !turn.usage) return;
    if (failed instanceof ContextEngineError && failed.retryable) {
      unreported.push({ build: built, usage: turn.usage, model: turn.model, error: failed });
      return;
    }
    try {
      reports.push(
        await this.reportUsage(built, turn.usage, undefined, { ...call, model: turn.model }),
      );
    } catch (error) {
      unreported.push({ build: built, usage: turn.usage, model: turn.model, error });
    }
  }
}

/** The logged result of `toolCall`, from what runTool returned for it. */
function resultItem(toolCall: ToolCallRequest, output: ToolOutput | string): ConversationItem {
  const out: ToolOutput = typeof output === 'string' ? { content: output } : output;
  return toolResult(toolCall.callId, toolCall.name, out.content, {
    trust: out.trust,
    source: out.source,
    isError: out.isError,
    artifactRef: out.artifactRef,
    contextContent: out.contextContent,
  });
}
