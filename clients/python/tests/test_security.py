"""Bearer tokens (good, bad, from the environment) and TLS with a CA file."""

import datetime
import ipaddress

import grpc
import pytest

import tinybroker
from conftest import run

TOKEN = "s3cret-token"


def test_token_good_bad_and_from_env(start_broker, monkeypatch):
    broker = start_broker({"TINYBROKER_AUTH_TOKEN": TOKEN})

    async def body():
        async with tinybroker.connect(broker.addr, token=TOKEN) as client:
            sub = await client.subscribe("s.>")
            await client.publish_confirmed("s.1", b"ok")
            assert (await sub.next(timeout=5)).payload == b"ok"
            assert (await client.admin.info()).auth_enabled
        async with tinybroker.connect(broker.addr, token="wrong") as client:
            for call in (client.publish_confirmed("s.1", b"no"), client.subscribe("s.>", timeout=5), client.admin.info()):
                with pytest.raises(tinybroker.TinybrokerError) as caught:
                    await call
                assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setenv("TINYBROKER_AUTH_TOKEN", TOKEN)
        async with tinybroker.connect(broker.addr) as client:
            await client.publish_confirmed("s.1", b"env")

    run(body())


def _make_certs(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject, issuer, key, signer, ca):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("tinybroker test CA", "tinybroker test CA", ca_key, ca_key, True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build("localhost", "tinybroker test CA", key, ca_key, False)
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(pem))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"


def test_tls_with_a_ca_file(start_broker, tmp_path):
    ca, cert, key = _make_certs(tmp_path)
    broker = start_broker({"TINYBROKER_TLS_CERT": str(cert), "TINYBROKER_TLS_KEY": str(key)})

    async def body():
        async with tinybroker.connect(f"https://{broker.addr}", ca_file=str(ca)) as client:
            sub = await client.subscribe("t.>")
            await client.publish_confirmed("t.1", b"secure")
            assert (await sub.next(timeout=5)).payload == b"secure"
            assert (await client.admin.info()).tls_enabled
        # Without the CA (system roots) the handshake fails; plaintext too.
        for addr, kwargs in ((f"https://{broker.addr}", {}), (broker.addr, {})):
            with pytest.raises(tinybroker.TinybrokerError) as caught:
                await tinybroker.connect(addr, connect_timeout=3, **kwargs)
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE

    run(body())
