// Typed errors: every failed RPC becomes a ContextEngineError (a subclass per status code)
// with the google.rpc details the server sends decoded once: ErrorInfo (a stable `reason`
// such as "ORPHANED_TOOL_ITEM", metadata such as the offending class) and BadRequest field
// violations ("items[0].tool_result.call_id"). Match on `reason` and `field`, never on text.

import path from 'node:path';
import { status as Status, type ServiceError } from '@grpc/grpc-js';
import protobuf from 'protobufjs';

import { PROTO_DIR } from './paths.js';
import type { ModelTurn } from './items.js';
import type { AppendItemsRequest } from './types.js';

export interface FieldViolation {
  field: string;
  description: string;
}

/** Base of everything this package throws. */
export class ClientError extends Error {
  override name = 'ClientError';
}

/** A failed RPC with its decoded status details. */
export class ContextEngineError extends ClientError {
  override name = 'ContextEngineError';
  constructor(
    readonly code: Status,
    /** The server's own message, as Python's `ContextEngineError.message` holds it. */
    readonly statusMessage: string,
    readonly reason: string = '',
    readonly domain: string = '',
    readonly metadata: Record<string, string> = {},
    readonly fieldViolations: FieldViolation[] = [],
  ) {
    super(`${Status[code]}: ${statusMessage}${reason ? ` [${reason}]` : ''}`);
  }

  /**
   * The key a keyed write was sent with ('' for other calls). The write may have landed
   * with only its answer lost (UNAVAILABLE, DEADLINE_EXCEEDED): resend it with this key
   * (`idempotencyKey`) to get the first answer rather than a second write.
   */
  idempotencyKey = '';

  /**
   * Set on every error a tool loop throws from its step's AppendItems, whether it failed
   * after the loop's own resends (UNAVAILABLE, DEADLINE_EXCEEDED) or was never resent
   * (UNAUTHENTICATED, INTERNAL, CANCELLED...): the request itself (its key and items, the
   * model's turn and the tool results), to resend unchanged with `run.resendAppend`; then,
   * unless `final`, run the loop again. (Another error thrown out of the append carries
   * it too.)
   */
  pendingRequest?: AppendItemsRequest;

  /**
   * On an error that ended a tool loop's step: the model's turn of that step, and whether it
   * was the final answer (no tool calls). After a final answer's failed append, resend
   * `pendingRequest` and stop: `turn` is the answer; another toolLoop would ask the model
   * again and log a second one.
   */
  turn?: ModelTurn;
  final?: boolean;

  /**
   * On an error from `openSession`, the session id its Plan was sent with ('' otherwise):
   * a Plan that timed out may have landed, and `openSession(spec, { sessionId })` with
   * this id finds it where a new id would open a second session.
   */
  sessionId = '';

  /** The status code's name, e.g. "ABORTED". */
  get codeName(): string {
    return Status[this.code];
  }

  /** The first offending field path, if the server named one. */
  get field(): string | undefined {
    return this.fieldViolations[0]?.field;
  }

  /**
   * True for UNAVAILABLE and DEADLINE_EXCEEDED, and for ABORTED with reason SESSION_BUSY
   * (another write held the session past the server's lock wait; nothing was written):
   * resend the same request with backoff, under the key it was sent with.
   */
  get retryable(): boolean {
    return (
      this.code === Status.UNAVAILABLE ||
      this.code === Status.DEADLINE_EXCEEDED ||
      (this.code === Status.ABORTED && this.reason === 'SESSION_BUSY')
    );
  }
}

/** The request is wrong; the same request fails again. */
export class InvalidArgumentError extends ContextEngineError {
  override name = 'InvalidArgumentError';
}
/** An unknown id, or one owned by another tenant (indistinguishable). */
export class NotFoundError extends ContextEngineError {
  override name = 'NotFoundError';
}
/** The state forbids the call (a plan that cannot open, a run in the wrong state). */
export class FailedPreconditionError extends ContextEngineError {
  override name = 'FailedPreconditionError';
}
/**
 * A lost optimistic race (checkpoint version, epoch): re-read and retry. Except reason
 * SESSION_BUSY (`retryable`): nothing was written; resend the same request under its key
 * without re-reading (an earlier attempt under that key may have landed).
 */
export class AbortedError extends ContextEngineError {
  override name = 'AbortedError';
}
/** The server or its database is unreachable; retry with backoff. */
/**
 * The server could not be reached, or is shutting down. The channel has already retried;
 * a write may have landed with only its answer lost, so a resend must carry the same key
 * (`idempotencyKey`).
 */
export class UnavailableError extends ContextEngineError {
  override name = 'UnavailableError';
}
/** No valid credentials, or not allowed to act for the tenant. */
export class AuthError extends ContextEngineError {
  override name = 'AuthError';
}
/** The server does not implement this RPC (an older server). */
export class UnimplementedError extends ContextEngineError {
  override name = 'UnimplementedError';
}
/** The request is larger than the server accepts. */
export class ResourceExhaustedError extends ContextEngineError {
  override name = 'ResourceExhaustedError';
}
/** The call's deadline passed; a write may still have landed (resend with its key). */
export class DeadlineExceededError extends ContextEngineError {
  override name = 'DeadlineExceededError';
}
/** The server failed; report it (nothing in the request is at fault). */
export class InternalError extends ContextEngineError {
  override name = 'InternalError';
}

type ErrorClass = new (
  code: Status,
  message: string,
  reason?: string,
  domain?: string,
  metadata?: Record<string, string>,
  fieldViolations?: FieldViolation[],
) => ContextEngineError;

// Table, not branches: status code -> error class; anything unlisted is the base class.
const BY_CODE: Partial<Record<Status, ErrorClass>> = {
  [Status.INVALID_ARGUMENT]: InvalidArgumentError,
  [Status.NOT_FOUND]: NotFoundError,
  [Status.FAILED_PRECONDITION]: FailedPreconditionError,
  [Status.ABORTED]: AbortedError,
  [Status.UNAVAILABLE]: UnavailableError,
  [Status.UNAUTHENTICATED]: AuthError,
  [Status.PERMISSION_DENIED]: AuthError,
  [Status.RESOURCE_EXHAUSTED]: ResourceExhaustedError,
  [Status.UNIMPLEMENTED]: UnimplementedError,
  [Status.DEADLINE_EXCEEDED]: DeadlineExceededError,
  [Status.INTERNAL]: InternalError,
};

let detailTypes: protobuf.Root | undefined;

function rpcRoot(): protobuf.Root {
  if (!detailTypes) {
    detailTypes = new protobuf.Root().loadSync(
      ['status.proto', 'error_details.proto'].map((f) => path.join(PROTO_DIR, 'google', 'rpc', f)),
      { keepCase: true },
    );
  }
  return detailTypes;
}

interface Details {
  message?: string;
  reason: string;
  domain: string;
  metadata: Record<string, string>;
  violations: FieldViolation[];
}

function decodeDetails(raw: Buffer): Details {
  const root = rpcRoot();
  const decode = (typeName: string, bytes: Uint8Array) => {
    const type = root.lookupType(typeName);
    return type.toObject(type.decode(bytes), { defaults: true, arrays: true, objects: true });
  };
  const out: Details = { reason: '', domain: '', metadata: {}, violations: [] };
  const status = decode('google.rpc.Status', raw);
  out.message = status.message;
  for (const detail of status.details as { type_url: string; value: Uint8Array }[]) {
    const typeName = detail.type_url.slice(detail.type_url.lastIndexOf('/') + 1);
    if (typeName === 'google.rpc.ErrorInfo') {
      const info = decode(typeName, detail.value);
      Object.assign(out, { reason: info.reason, domain: info.domain, metadata: { ...info.metadata } });
    } else if (typeName === 'google.rpc.BadRequest') {
      for (const v of decode(typeName, detail.value).field_violations as FieldViolation[]) {
        out.violations.push({ field: v.field, description: v.description });
      }
    }
  }
  return out;
}

/** Decode a grpc-js ServiceError into the typed error for its status. */
export function fromServiceError(error: ServiceError): ContextEngineError {
  let details: Details = { reason: '', domain: '', metadata: {}, violations: [] };
  try {
    const raw = error.metadata?.get('grpc-status-details-bin')?.[0];
    if (raw instanceof Buffer) details = decodeDetails(raw);
  } catch {
    // Undecodable details still leave a typed error with the status code and message.
  }
  const Cls = BY_CODE[error.code] ?? ContextEngineError;
  const message = details.message || error.details || error.message;
  return new Cls(error.code, message, details.reason, details.domain, details.metadata, details.violations);
}

/** Build reported needsCompaction and the tool loop was given no summarizer. */
export class NeedsCompactionError extends ClientError {
  override name = 'NeedsCompactionError';
  constructor(readonly build: unknown) {
    super('the body does not fit even after every cheaper yield: compact and build again');
  }
}

/** The tool loop took maxSteps model turns without a final answer. */
export class ToolLoopLimitError extends ClientError {
  override name = 'ToolLoopLimitError';
  constructor(readonly steps: number) {
    super(`no final answer after ${steps} model turns`);
  }
}
