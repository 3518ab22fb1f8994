package chart

import (
	"bufio"
	"debug/elf"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"

	"github.com/Masterminds/semver/v3"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// TestDockerfileBuildStage runs the Dockerfile's build stage without a Docker
// engine: the sources the build stage copies (minus what .dockerignore keeps
// out) go into an empty directory and its `go build` line runs there as
// written. That proves the build context is enough to build the binary, the
// binary is static (it runs on the slim base with no libc of Go's choosing),
// and the version and commit build arguments reach `--version`.
func TestDockerfileBuildStage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the whole binary; skipped in -short mode")
	}
	root := render.RepoRoot()
	build := parseBuildStage(t, filepath.Join(root, "Dockerfile"))

	if want := goDirective(t, filepath.Join(root, "go.mod")); !versionAtLeast(t, build.goVersion, want) {
		t.Errorf("build image has Go %s, go.mod needs %s", build.goVersion, want)
	}

	ctxDir := t.TempDir()
	for _, src := range build.copies {
		copyContext(t, filepath.Join(root, src), filepath.Join(ctxDir, src))
	}
	out := t.TempDir()
	const version, commit = "v9.8.7-dockerfile-test", "0123abc"
	script := build.goBuild
	for k, v := range map[string]string{
		"$TARGETOS": "linux", "$TARGETARCH": runtime.GOARCH,
		"${VERSION}": version, "${COMMIT}": commit, "/out/": out + "/",
	} {
		script = strings.ReplaceAll(script, k, v)
	}
	cmd := exec.Command("sh", "-c", script)
	cmd.Dir = ctxDir
	cmd.Env = append(os.Environ(), build.env...)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the Dockerfile's build step failed in a context holding only %v: %v\n%s", build.copies, err, b)
	}

	bin := filepath.Join(out, filepath.Base(build.output))
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary asks for a dynamic loader; it must be static")
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("the binary links %v; it must be static", libs)
	}
	got, err := exec.Command(bin, "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("--version: %v\n%s", err, got)
	}
	if s := string(got); !strings.Contains(s, version) || !strings.Contains(s, commit) {
		t.Errorf("--version printed %q, want the stamped %s and %s", s, version, commit)
	}
	if build.output != "/out/harvester-csi-driver" || !strings.Contains(build.final, "COPY --from=build "+build.output+" /usr/bin/harvester-csi-driver") ||
		!strings.Contains(build.final, `ENTRYPOINT ["/usr/bin/harvester-csi-driver"]`) {
		t.Errorf("the final stage does not run the binary the build stage produced (%s)", build.output)
	}
}

type buildStage struct {
	goVersion string   // from the golang base image tag
	env       []string // ENV of the build stage
	copies    []string // context paths COPY brings in
	goBuild   string   // the RUN line with `go build`, cache mounts dropped
	output    string   // its -o
	final     string   // the text of the last stage
}

func parseBuildStage(t *testing.T, path string) buildStage {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Join continuation lines so each instruction is one line.
	text := strings.ReplaceAll(string(data), "\\\n", " ")
	stages := regexp.MustCompile(`(?m)^FROM `).Split(text, -1)
	if len(stages) < 3 {
		t.Fatalf("want a build stage and a final stage, found %d FROM lines", len(stages)-1)
	}
	var b buildStage
	b.final = stages[len(stages)-1]
	m := regexp.MustCompile(`^\S*\s*golang:(\d+\.\d+(?:\.\d+)?)`).FindStringSubmatch(strings.TrimPrefix(stages[1], "--platform=$BUILDPLATFORM "))
	if m == nil {
		t.Fatalf("the build stage does not start from a golang image: %.80s", stages[1])
	}
	b.goVersion = m[1]
	sc := bufio.NewScanner(strings.NewReader(stages[1]))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		switch fields[0] {
		case "ENV":
			b.env = append(b.env, fields[1:]...)
		case "COPY":
			if strings.HasPrefix(fields[1], "--from") {
				continue
			}
			b.copies = append(b.copies, fields[1:len(fields)-1]...)
		case "RUN":
			line := strings.Join(fields[1:], " ")
			if !strings.Contains(line, "go build") {
				continue
			}
			line = regexp.MustCompile(`--mount=\S+\s*`).ReplaceAllString(line, "")
			b.goBuild = line
			if o := regexp.MustCompile(`-o\s+(\S+)`).FindStringSubmatch(line); o != nil {
				b.output = o[1]
			}
		}
	}
	if b.goBuild == "" || b.output == "" || len(b.copies) == 0 {
		t.Fatalf("build stage not understood: %+v", b)
	}
	return b
}

// copyContext copies a build-context path the way .dockerignore filters it:
// no tests, no testdata.
func copyContext(t *testing.T, src, dst string) {
	t.Helper()
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir() && d.Name() == "testdata":
			return filepath.SkipDir
		case d.IsDir():
			return os.MkdirAll(target, 0o755)
		case strings.HasSuffix(d.Name(), "_test.go"):
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(target, data, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func goDirective(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\S+)`).FindSubmatch(data)
	if m == nil {
		t.Fatalf("%s has no go directive", path)
	}
	return string(m[1])
}

func versionAtLeast(t *testing.T, have, want string) bool {
	t.Helper()
	h, err := semver.NewVersion(have)
	if err != nil {
		t.Fatal(err)
	}
	w, err := semver.NewVersion(want)
	if err != nil {
		t.Fatal(err)
	}
	return !h.LessThan(w)
}
