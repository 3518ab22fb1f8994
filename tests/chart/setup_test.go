package chart

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// CI must not be kinder than a user's machine: whatever .ci/run would install
// for the tests, `make test` and `make lab` (the README's commands) would not,
// and a fresh clone would fail where CI passes. So .ci/run installs nothing
// itself, and both targets run hack/os-deps.sh.
func TestCIInstallsNothingTheREADMECommandsDoNot(t *testing.T) {
	root := render.RepoRoot()
	ci, err := os.ReadFile(filepath.Join(root, ".ci", "run"))
	if err != nil {
		t.Fatal(err)
	}
	install := regexp.MustCompile(`(?m)^[^#\n]*\b(apt-get|apt|dpkg|yum|dnf|apk|zypper|pip3?|npm)\s+(-\S+\s+)*(install|add|-i)\b`)
	for _, m := range install.FindAllString(string(ci), -1) {
		t.Errorf(".ci/run installs something itself (%q): put it in hack/os-deps.sh, which `make test` and `make lab` run", strings.TrimSpace(m))
	}
	for _, target := range []string{"test", "lab"} {
		cmd := exec.Command("make", "-n", target)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("make -n %s: %v: %s", target, err, out)
		}
		if !strings.Contains(string(out), "hack/os-deps.sh") {
			t.Errorf("`make %s` does not run hack/os-deps.sh, so a fresh machine lacks what the tests need:\n%s", target, out)
		}
	}
}

// Every command the node service and the test kit run on a fresh machine is
// named in hack/os-deps.sh with its package.
func TestOSDepsNameEveryToolTheNodeRuns(t *testing.T) {
	root := render.RepoRoot()
	deps, err := os.ReadFile(filepath.Join(root, "hack", "os-deps.sh"))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+([a-z0-9_.]+):[a-z0-9.+-]+$`).FindAllStringSubmatch(string(deps), -1) {
		listed[m[1]] = true
	}
	if len(listed) == 0 {
		t.Fatal("hack/os-deps.sh lists no command:package pairs")
	}
	used := map[string]bool{}
	call := regexp.MustCompile(`\b(?:run|runWith|Run|CommandContext|Command)\((?:ctx, |t, )?(?:\[\]\*os\.File\{[^}]*\}, )?"([a-z][a-z0-9_.]*)"`)
	for _, src := range goSources(t, "pkg/node", "internal/loopdisk", "internal/nodetest") {
		for _, m := range call.FindAllStringSubmatch(src, -1) {
			used[m[1]] = true
		}
	}
	// mkfs.<type> is run by type name.
	for _, fs := range []string{"ext4", "xfs"} {
		used["mkfs."+fs] = true
	}
	for cmd := range used {
		if strings.HasSuffix(cmd, ".") {
			continue // a prefix such as "mkfs." completed at run time (above)
		}
		switch cmd {
		case "bash", "sleep", "sh", "true", "nsenter":
			continue // in every base image
		}
		if !listed[cmd] {
			t.Errorf("the node side runs %q, which hack/os-deps.sh does not install", cmd)
		}
	}
}

// goSources are the non-test Go files below the repository's dirs.
func goSources(t *testing.T, dirs ...string) []string {
	t.Helper()
	var out []string
	for _, dir := range dirs {
		err := filepath.WalkDir(filepath.Join(render.RepoRoot(), dir), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			b, err := os.ReadFile(p)
			out = append(out, string(b))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}
