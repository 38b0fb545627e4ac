// grpc.health.v1 Check of the whole server, with a hand-written codec (no
// .proto loading): SERVING, NOT_SERVING or an error name.
import * as grpc from "@grpc/grpc-js";

export function health(addr) {
  const client = new grpc.Client(addr, grpc.credentials.createInsecure());
  return new Promise((resolve) => {
    client.makeUnaryRequest(
      "/grpc.health.v1.Health/Check",
      (b) => b,
      (b) => b,
      Buffer.alloc(0),
      { deadline: Date.now() + 2000 },
      (err, response) => {
        client.close();
        if (err) return resolve(grpc.status[err.code]);
        // HealthCheckResponse { ServingStatus status = 1; }: 1 SERVING, 2 NOT_SERVING.
        const hex = Buffer.from(response).toString("hex");
        resolve({ "0801": "SERVING", "0802": "NOT_SERVING" }[hex] ?? hex);
      },
    );
  });
}
