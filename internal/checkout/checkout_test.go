package checkout

import (
	"os"
	"path/filepath"
	"testing"
)

func TestRootHoldsThisModulesGoMod(t *testing.T) {
	root, err := Root()
	if err != nil {
		t.Fatal(err)
	}
	if !filepath.IsAbs(root) || !IsRoot(root) {
		t.Fatalf("Root() = %q: not an absolute directory with this module's go.mod", root)
	}
	if _, err := os.Stat(filepath.Join(root, "hack", "tools.sh")); err != nil {
		t.Errorf("Root() = %q has no hack/tools.sh: %v", root, err)
	}
}

// A walk from inside tools/ passes the tools modules' own go.mod files.
func TestAbovePassesOtherModules(t *testing.T) {
	dir := t.TempDir()
	write := func(rel, body string) {
		t.Helper()
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "// the checkout\nmodule "+Module+"\n\ngo 1.26.0\n")
	write("tools/kube/go.mod", "module "+Module+"/tools/kube\n")
	write("tools/kube/pkg/x.go", "package x\n")
	got, err := Above(filepath.Join(dir, "tools", "kube", "pkg"))
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := filepath.Abs(dir); got != want {
		t.Errorf("Above(tools/kube/pkg) = %q, want %q", got, want)
	}
	if _, err := Above(filepath.Join(dir, "..")); err == nil {
		t.Error("Above of a directory outside any checkout found one")
	}
}
