// The message types a worker touches, re-exported under short names from the code that
// proto-loader-gen-types generates from proto/ on every build (src/generated/, not
// committed). Input types are permissive (every field optional); `...Output` types are
// what the server returns, with defaults filled in.

export type { AgentSpec } from './generated/context_engine/v1/AgentSpec';
export type { AppendItemsResponse__Output as AppendItemsResponse } from './generated/context_engine/v1/AppendItemsResponse';
export type { BuildRequest } from './generated/context_engine/v1/BuildRequest';
export type { BuildResponse__Output as BuildResponse } from './generated/context_engine/v1/BuildResponse';
export type { ContentBlock__Output as ContentBlock } from './generated/context_engine/v1/ContentBlock';
export type { ContextPlan__Output as ContextPlan } from './generated/context_engine/v1/ContextPlan';
export type { ConversationItem } from './generated/context_engine/v1/ConversationItem';
export type { ModelRequest__Output as ModelRequest } from './generated/context_engine/v1/ModelRequest';
export type { PlanSpec } from './generated/context_engine/v1/PlanSpec';
export type { PrepareCompactionResponse__Output as PrepareCompactionResponse } from './generated/context_engine/v1/PrepareCompactionResponse';
export type { PressureReport__Output as PressureReport } from './generated/context_engine/v1/PressureReport';
export type { Principal } from './generated/context_engine/v1/Principal';
export type { ReportUsageResponse__Output as ReportUsageResponse } from './generated/context_engine/v1/ReportUsageResponse';
export type { RunAdmission } from './generated/context_engine/v1/RunAdmission';
export type { SessionEnvironment } from './generated/context_engine/v1/SessionEnvironment';
export type { StepContext } from './generated/context_engine/v1/StepContext';
export type { ToolSpec } from './generated/context_engine/v1/ToolSpec';
export type { TrustLevel } from './generated/context_engine/v1/TrustLevel';
export type { PlanReason } from './generated/context_engine/v1/PlanReason';
export type { SideEffect } from './generated/context_engine/v1/SideEffect';
export type { ContextEngineClient as RawContextEngineClient } from './generated/context_engine/v1/ContextEngine';
export type { ProtoGrpcType } from './generated/context_engine';
