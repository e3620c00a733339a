import path from 'node:path';
import { fileURLToPath } from 'node:url';

/**
 * The package's copy of the .proto files (written by the service's `make proto`), loaded
 * at run time. Compiled code lives in dist/src/, so the package root is two levels up.
 */
export const PROTO_DIR = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', 'proto');
