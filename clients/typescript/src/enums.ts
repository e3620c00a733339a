// Enum values in a request, checked before it is sent. proto-loader (enums: String) encodes
// an enum string it does not know as 0 without a word, and 0 is a valid value on the wire,
// so the server cannot tell: a misspelled trust ('EXTERNAL_UNTRUSED') became UNSPECIFIED and
// a skill catalog entry rendered as trusted configuration. TypeScript's types catch such a
// typo at compile time; JavaScript callers and specs read from JSON do not.

import path from 'node:path';
import protobuf from 'protobufjs';

import { PROTO_DIR } from './paths.js';

const SERVICE = 'context_engine.v1.ContextEngine';

let root: protobuf.Root | undefined;

function requestType(method: string): protobuf.Type {
  if (!root) {
    root = new protobuf.Root();
    root.resolvePath = (_origin, target) => path.join(PROTO_DIR, target);
    root.loadSync('context_engine/v1/context_engine.proto', { keepCase: true });
    root.resolveAll();
  }
  const service = root.lookupService(SERVICE);
  return root.lookupType(service.methods[method].requestType);
}

/**
 * The first enum field of `request` holding a value its enum does not have (a name or a
 * number), as [field path, message]; undefined when every enum value is known.
 */
export function unknownEnumValue(method: string, request: unknown): [string, string] | undefined {
  return walk(requestType(method), request, '');
}

/**
 * A name the enum has, or a number it has: its own entries only (protobufjs's `values`
 * inherits the numbers and Object's own names, "3" and "toString" among them), and never
 * a number as a string, which protobufjs would send as 0.
 */
function known(type: protobuf.Enum, value: unknown): boolean {
  if (typeof value === 'number') return Object.hasOwn(type.valuesById, value);
  return typeof value === 'string' && Object.hasOwn(type.values, value) && !/^\d+$/.test(value);
}

function walk(type: protobuf.Type, value: unknown, prefix: string): [string, string] | undefined {
  if (value === null || typeof value !== 'object') return undefined;
  const fields = value as Record<string, unknown>;
  for (const field of type.fieldsArray) {
    const present = fields[field.name];
    if (present === undefined || present === null || field.map) continue;
    const items = field.repeated && Array.isArray(present) ? present : [present];
    for (const [n, item] of items.entries()) {
      const at = field.repeated ? `${prefix}${field.name}[${n}]` : `${prefix}${field.name}`;
      const resolved = field.resolvedType;
      if (resolved instanceof protobuf.Enum) {
        if (!known(resolved, item)) {
          return [at, `${JSON.stringify(item)} is not a ${resolved.name} value`];
        }
      } else if (resolved instanceof protobuf.Type) {
        const found = walk(resolved, item, `${at}.`);
        if (found) return found;
      }
    }
  }
  return undefined;
}
