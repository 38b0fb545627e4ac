/** Where a client connects when given no address and no `TINYBROKER_ADDR`. */
export declare const DEFAULT_ADDR = "127.0.0.1:50051";
/** One broker address: `host:port` and whether it speaks TLS. */
export interface Target {
    readonly address: string;
    readonly tls: boolean;
}
