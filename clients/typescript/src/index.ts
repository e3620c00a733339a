// @context-engine/client: a typed Node.js client for the context-engine gRPC service.
// The public surface is what this file exports.

export {
  BuildResult,
  ContextEngineClient,
  LOAD_OPTIONS,
  MAX_WIRE_NAME,
  Run,
  SERVICE,
  Session,
  protoPackage,
  wireToolName,
  type BuildOptions,
  type ClientOptions,
  type CompactOptions,
  type MethodName,
  type RequestOf,
  type ResponseOf,
  type ToolLoopOptions,
  type ToolLoopResult,
} from './client.js';
export {
  AbortedError,
  AuthError,
  ClientError,
  ContextEngineError,
  DeadlineExceededError,
  FailedPreconditionError,
  InternalError,
  InvalidArgumentError,
  NeedsCompactionError,
  NotFoundError,
  ResourceExhaustedError,
  ToolLoopLimitError,
  UnavailableError,
  UnimplementedError,
  fromServiceError,
  type FieldViolation,
} from './errors.js';
export {
  assistantMessage,
  tool,
  toolCall,
  toolResult,
  turnItems,
  usageFromAnthropic,
  usageFromOpenAI,
  userMessage,
  type ModelTurn,
  type ToolCallRequest,
  type ToolOutput,
  type Usage,
} from './items.js';
export { PROTO_DIR } from './paths.js';
export type * from './types.js';
