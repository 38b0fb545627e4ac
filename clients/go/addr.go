package tinybroker

import (
	"fmt"
	"net"
	"os"
	"strings"
)

// DefaultAddr is the address used when none is given and TINYBROKER_ADDR is unset.
const DefaultAddr = "127.0.0.1:50051"

type target struct {
	hostport string
	tls      bool
}

func (t target) String() string {
	if t.tls {
		return "https://" + t.hostport
	}
	return "http://" + t.hostport
}

// parseAddrs reads "host:port", "http://host:port" and "https://host:port"
// (a missing port is 50051, or 443 with https); nil or empty reads
// TINYBROKER_ADDR (comma-separated), else DefaultAddr.
func parseAddrs(addrs []string) ([]target, error) {
	if len(addrs) == 0 {
		env := os.Getenv("TINYBROKER_ADDR")
		if env == "" {
			env = DefaultAddr
		}
		addrs = strings.Split(env, ",")
	}
	var out []target
	for _, raw := range addrs {
		item := strings.TrimRight(strings.TrimSpace(raw), "/")
		if item == "" {
			continue
		}
		t := target{}
		switch {
		case strings.HasPrefix(item, "https://"):
			t.tls, item = true, item[len("https://"):]
		case strings.HasPrefix(item, "http://"):
			item = item[len("http://"):]
		case strings.Contains(item, "://"):
			return nil, usageError("broker address %q: the scheme must be http:// or https://", raw)
		}
		if item == "" {
			return nil, usageError("broker address %q: no host", raw)
		}
		if _, _, err := net.SplitHostPort(item); err != nil {
			port := "50051"
			if t.tls {
				port = "443"
			}
			item = net.JoinHostPort(strings.Trim(item, "[]"), port)
			if _, _, err := net.SplitHostPort(item); err != nil {
				return nil, usageError("broker address %q: %v", raw, err)
			}
		}
		t.hostport = item
		out = append(out, t)
	}
	if len(out) == 0 {
		return nil, usageError("no broker address in %s", fmt.Sprint(addrs))
	}
	return out, nil
}
