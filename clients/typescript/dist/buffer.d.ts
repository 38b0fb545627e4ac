import type { PublishRequest } from "./gen/tinybroker/v1/broker.js";
/** How the buffer writes: the session's state and its stream. */
export interface BatchWriter {
    /** Whether the session is OPEN (batches can be written). */
    writable(): boolean;
    /** Writes one SessionPublish. */
    writePublish(id: number, messages: PublishRequest[]): void;
}
