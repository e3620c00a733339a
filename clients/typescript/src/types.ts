// The message types a worker touches, re-exported under short names from the code that
// proto-loader-gen-types generates from proto/ on every build (src/generated/, not
// committed). Input types are permissive (every field optional); `...Output` types are
// what the server returns, with defaults filled in.

export type { AgentSpec } from './generated/context_engine/v1/AgentSpec.js';
export type { AppendItemsRequest } from './generated/context_engine/v1/AppendItemsRequest.js';
export type { AppendItemsResponse__Output as AppendItemsResponse } from './generated/context_engine/v1/AppendItemsResponse.js';
export type { Attachment } from './generated/context_engine/v1/Attachment.js';
export type { AttachmentPlacement__Output as AttachmentPlacement } from './generated/context_engine/v1/AttachmentPlacement.js';
export type { BuildRequest } from './generated/context_engine/v1/BuildRequest.js';
export type { BuildResponse__Output as BuildResponse } from './generated/context_engine/v1/BuildResponse.js';
export type { ContentBlock__Output as ContentBlock } from './generated/context_engine/v1/ContentBlock.js';
export type { EraseSubjectResponse__Output as EraseSubjectResponse } from './generated/context_engine/v1/EraseSubjectResponse.js';
export type { ContextPlan__Output as ContextPlan } from './generated/context_engine/v1/ContextPlan.js';
export type { ConversationItem } from './generated/context_engine/v1/ConversationItem.js';
export type { ModelRequest__Output as ModelRequest } from './generated/context_engine/v1/ModelRequest.js';
export type { OfferFactCandidatesResponse__Output as OfferFactCandidatesResponse } from './generated/context_engine/v1/OfferFactCandidatesResponse.js';
export type { PlanSpec } from './generated/context_engine/v1/PlanSpec.js';
export type { PrepareCompactionResponse__Output as PrepareCompactionResponse } from './generated/context_engine/v1/PrepareCompactionResponse.js';
export type { PressureReport__Output as PressureReport } from './generated/context_engine/v1/PressureReport.js';
export type { Principal } from './generated/context_engine/v1/Principal.js';
export type { ReportUsageResponse__Output as ReportUsageResponse } from './generated/context_engine/v1/ReportUsageResponse.js';
export type { RunAdmission } from './generated/context_engine/v1/RunAdmission.js';
export type { LoadSkillResponse__Output as LoadSkillResponse } from './generated/context_engine/v1/LoadSkillResponse.js';
export type { UpdateWorkingStateResponse__Output as UpdateWorkingStateResponse } from './generated/context_engine/v1/UpdateWorkingStateResponse.js';
export type { WorkingStateUpdate } from './generated/context_engine/v1/WorkingStateUpdate.js';
export type { Writer } from './generated/context_engine/v1/Writer.js';
export type { SessionEnvironment } from './generated/context_engine/v1/SessionEnvironment.js';
export type { StepContext } from './generated/context_engine/v1/StepContext.js';
export type { ToolSpec } from './generated/context_engine/v1/ToolSpec.js';
export type { ToolSpec__Output as ToolSpecOutput } from './generated/context_engine/v1/ToolSpec.js';
export type { TrustLevel } from './generated/context_engine/v1/TrustLevel.js';
export type { PlanReason } from './generated/context_engine/v1/PlanReason.js';
export type { SideEffect } from './generated/context_engine/v1/SideEffect.js';
export type { ContextEngineClient as RawContextEngineClient } from './generated/context_engine/v1/ContextEngine.js';
export type { ProtoGrpcType } from './generated/context_engine.js';
