package tinybroker

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

// selfSigned writes a certificate for 127.0.0.1 and its key (PEM).
func selfSigned(t *testing.T) (certFile, keyFile string) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "tinybroker test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:         true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

func TestTLS(t *testing.T) {
	cert, key := selfSigned(t)
	b := startBroker(t, map[string]string{"TINYBROKER_TLS_CERT": cert, "TINYBROKER_TLS_KEY": key})
	c := connect(t, []string{"https://" + b.addr}, WithCAFile(cert))
	if c.Address() != "https://"+b.addr {
		t.Fatalf("address %s", c.Address())
	}
	sub := subscribe(t, c, []string{"tls.>"})
	publishAsync(t, c, "tls.a", []byte("secret"))
	if m := next(t, sub, 5*time.Second); string(m.Payload) != "secret" {
		t.Fatal("wrong message")
	}
	// Without the CA the certificate is not trusted: no broker answers.
	_, err := Connect(ctxT(t, 10*time.Second), []string{"https://" + b.addr}, WithConnectTimeout(time.Second))
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Unavailable {
		t.Fatalf("without the CA: %v", err)
	}
}
