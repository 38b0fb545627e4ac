package tinybroker

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// The README's first Go block runs as written: copied into a fresh module
// that takes this checkout's client the way the README's install lines say
// (a replace), run with `go run` against a broker, whose address it reads
// from TINYBROKER_ADDR as it would read the default one.
func TestReadmeFirstExampleRunsAsWritten(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a program of its own")
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile("(?s)```go\n(.*?)```").FindSubmatch(readme)
	if block == nil || !strings.Contains(string(block[1]), "package main") {
		t.Fatal("README.md has no Go block with a main package")
	}
	here, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name, text string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("main.go", string(block[1]))
	// The client's own go.mod and go.sum give the versions of its
	// dependencies, as `go get` would in a user's module.
	gomod, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	gosum, err := os.ReadFile("go.sum")
	if err != nil {
		t.Fatal(err)
	}
	requires := regexp.MustCompile(`(?m)^\t(google\.golang\.org/\S+|golang\.org/x/\S+) (\S+)`).FindAllStringSubmatch(string(gomod), -1)
	mod := "module readme\n\ngo 1.26.0\n\nrequire github.com/tinybroker/tinybroker/clients/go v0.0.0\n\nrequire (\n"
	for _, r := range requires {
		mod += "\t" + r[1] + " " + r[2] + "\n"
	}
	mod += ")\n\nreplace github.com/tinybroker/tinybroker/clients/go => " + here + "\n"
	write("go.mod", mod)
	write("go.sum", string(gosum))

	b := startBroker(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	run := exec.CommandContext(ctx, "go", "run", ".")
	run.Dir = dir
	run.Env = append(os.Environ(), "TINYBROKER_ADDR="+b.addr, "GOFLAGS=-mod=mod")
	out, err := run.CombinedOutput()
	if err != nil {
		t.Fatalf("go run of README's first block: %v\n%s", err, out)
	}
	for _, want := range []string{"accepted 1, rejected 0", "received greetings.world: hello map[lang:en]"} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("README's first block printed no %q:\n%s", want, out)
		}
	}
}
