package chart

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/repo"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// repoVersion is the VERSION file: the one version of the binary, the image
// and the chart.
func repoVersion(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(render.RepoRoot(), "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	v := strings.TrimSpace(string(b))
	if !regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$`).MatchString(v) {
		t.Fatalf("VERSION %q is not major.minor.patch[-pre] (no leading v)", v)
	}
	return v
}

// makeDry prints the commands a make target would run, without running them.
func makeDry(t *testing.T, dir string, args ...string) string {
	t.Helper()
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not installed")
	}
	cmd := exec.Command("make", append([]string{"--no-print-directory", "-n"}, args...)...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("make -n %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// TestOneVersionEverywhere: the binary's -ldflags, the image tag, the chart's
// version and appVersion and the image the chart deploys by default all come
// from the VERSION file.
func TestOneVersionEverywhere(t *testing.T) {
	v := repoVersion(t)
	tag := "v" + v
	root := render.RepoRoot()
	ch := loadChart(t)
	if err := render.CheckVersion(ch, v); err != nil {
		t.Error(err)
	}
	if got := nested(t, renderSet(t, valueSet{name: "default"}).eff, "image", "harvester", "csiDriver", "tag"); got != "" {
		t.Errorf("values.yaml pins the driver tag %v; leave it empty so the chart's appVersion (from VERSION) applies", got)
	}
	repoName := sprint(nested(t, renderSet(t, valueSet{name: "default"}).eff, "image", "harvester", "csiDriver", "repository"))
	wantImage := repoName + ":" + tag
	images, err := render.Images(ch, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !contains(images, wantImage) {
		t.Errorf("the chart deploys %v, want the driver image %s", images, wantImage)
	}

	if out := makeDry(t, root, "build"); !strings.Contains(out, "-X main.version="+tag+" ") {
		t.Errorf("make build does not stamp %s:\n%s", tag, out)
	}
	if out := makeDry(t, root, "image"); !strings.Contains(out, "--build-arg VERSION="+tag+" ") || !strings.Contains(out, "-t "+wantImage+" ") {
		t.Errorf("make image does not build %s stamped %s:\n%s", wantImage, tag, out)
	}
	// A VERSION given on the command line cannot split the versions apart.
	if out := makeDry(t, root, "image", "VERSION=9.9.9"); strings.Contains(out, "9.9.9") {
		t.Errorf("make image VERSION=9.9.9 overrides the VERSION file:\n%s", out)
	}
	out, err := exec.Command("make", "--no-print-directory", "-s", "-C", root, "version").Output()
	if err != nil || strings.TrimSpace(string(out)) != tag {
		t.Errorf("make version printed %q (%v), want %s", out, err, tag)
	}
}

// TestReleaseTargets checks what `make release` would run without a Docker
// engine: a multi-architecture buildx build of the image with the version
// stamped, pushed or written as an OCI archive, and the chart packaging.
func TestReleaseTargets(t *testing.T) {
	v := repoVersion(t)
	tag := "v" + v
	root := render.RepoRoot()

	pushed := makeDry(t, root, "release", "PUSH=true", "REGISTRY=registry.example.com/", "COMMIT=abc123")
	for _, want := range []string{
		"docker buildx build --platform linux/amd64,linux/arm64 --build-arg VERSION=" + tag + " --build-arg COMMIT=abc123 " +
			"-t registry.example.com/harvester-csi/harvester-csi-driver:" + tag,
		"--push .",
		"chartctl release " + filepath.Join(root, "dist") + " " + v,
	} {
		if !strings.Contains(strings.ReplaceAll(pushed, "\\\n\t", ""), want) {
			t.Errorf("make release PUSH=true does not run %q:\n%s", want, pushed)
		}
	}
	local := makeDry(t, root, "release-image", "DIST=/tmp/out")
	if !strings.Contains(local, "--output type=oci,dest=/tmp/out/harvester-csi-driver-"+tag+".oci.tar") || strings.Contains(local, "--push") {
		t.Errorf("make release-image without PUSH must write an OCI archive and not push:\n%s", local)
	}

	// The Dockerfile must allow the cross-build: the build stage runs on the
	// build machine and compiles for BuildKit's target architecture.
	df, err := os.ReadFile(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"FROM --platform=$BUILDPLATFORM ", "ARG TARGETARCH", "GOARCH=$TARGETARCH"} {
		if !strings.Contains(string(df), want) {
			t.Errorf("the Dockerfile lacks %q: make release's --platform list would not cross-compile", want)
		}
	}
}

// TestReleaseChartWritesARepository runs `make release-chart` for real: the
// chart archive, an index.yaml that a chart repository serves (merged with the
// versions already listed), and the image list.
func TestReleaseChartWritesARepository(t *testing.T) {
	if testing.Short() {
		t.Skip("builds chartctl")
	}
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not installed")
	}
	v := repoVersion(t)
	dist := t.TempDir()
	const url = "https://charts.example.com/harvester-csi"
	// A repository that already lists an older release.
	old := repo.NewIndexFile()
	oldMeta := &chart.Metadata{APIVersion: chart.APIVersionV2, Name: "harvester-csi-driver", Version: "0.0.1", AppVersion: "v0.0.1"}
	if err := old.MustAdd(oldMeta, "harvester-csi-driver-0.0.1.tgz", url, "sha256:00"); err != nil {
		t.Fatal(err)
	}
	if err := old.WriteFile(filepath.Join(dist, "index.yaml"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("make", "--no-print-directory", "release-chart", "DIST="+dist, "CHART_REPO_URL="+url)
	cmd.Dir = render.RepoRoot()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("make release-chart: %v\n%s", err, out)
	}

	archive := filepath.Join(dist, "harvester-csi-driver-"+v+".tgz")
	ch, err := loader.Load(archive)
	if err != nil {
		t.Fatalf("the packaged chart: %v", err)
	}
	if err := render.CheckVersion(ch, v); err != nil {
		t.Error(err)
	}
	idx, err := repo.LoadIndexFile(filepath.Join(dist, "index.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := idx.Get("harvester-csi-driver", v)
	if err != nil {
		t.Fatalf("index.yaml does not list version %s: %v", v, err)
	}
	data, err := os.ReadFile(archive)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if got.AppVersion != "v"+v || len(got.URLs) != 1 || got.URLs[0] != url+"/harvester-csi-driver-"+v+".tgz" || got.Digest != hex.EncodeToString(sum[:]) {
		t.Errorf("index entry: appVersion %q, urls %v, digest %s (archive %x)", got.AppVersion, got.URLs, got.Digest, sum)
	}
	// Rancher resolves a relative icon against the chart repository's URL: the icon travels with the repository.
	if icon, err := os.ReadFile(filepath.Join(dist, got.Icon)); err != nil || strings.Contains(got.Icon, "/") {
		t.Errorf("index entry icon %q is not a file next to index.yaml: %v", got.Icon, err)
	} else if src, _ := os.ReadFile(filepath.Join(render.RepoRoot(), strings.TrimPrefix(ch.Metadata.Icon, "file://"))); string(src) != string(icon) {
		t.Errorf("%s differs from the chart's icon %s", got.Icon, ch.Metadata.Icon)
	}
	if _, err := idx.Get("harvester-csi-driver", "0.0.1"); err != nil {
		t.Errorf("the release dropped a version the repository already listed: %v", err)
	}

	listed, err := os.ReadFile(filepath.Join(dist, "images.txt"))
	if err != nil {
		t.Fatal(err)
	}
	want, err := render.Images(ch, nil)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(want, "\n")+"\n" != string(listed) {
		t.Errorf("images.txt:\n%s\nwant:\n%s", listed, strings.Join(want, "\n"))
	}
}

// TestSetVersion runs `make set-version` on a copy of the files it edits.
func TestSetVersion(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not installed")
	}
	root, dir := render.RepoRoot(), t.TempDir()
	rke2 := filepath.Join("deploy", "rke2", "harvester-csi-driver-helmchartconfig.yaml")
	for _, f := range []string{"Makefile", "VERSION", filepath.Join("charts", "harvester-csi-driver", "Chart.yaml"), filepath.Join("docs", "install.md"), rke2} {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, f)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run := func(args ...string) error {
		cmd := exec.Command("make", append([]string{"--no-print-directory", "-s"}, args...)...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Logf("make %v: %s", args, out)
		}
		return err
	}
	if err := run("set-version", "NEW=v1.2"); err == nil {
		t.Error("make set-version NEW=v1.2 accepted a version that is not major.minor.patch")
	}
	if err := run("set-version", "NEW=1.2.3-rc.1"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, rke2)); err != nil || !strings.Contains(string(b), "tag: v1.2.3-rc.1") {
		t.Errorf("make set-version left the RKE2 HelmChartConfig's image tag (%v):\n%s", err, b)
	}
	meta, err := chartutil.LoadChartfile(filepath.Join(dir, "charts", "harvester-csi-driver", "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "VERSION"))
	if strings.TrimSpace(string(b)) != "1.2.3-rc.1" || meta.Version != "1.2.3-rc.1" || meta.AppVersion != "v1.2.3-rc.1" {
		t.Errorf("after set-version: VERSION %q, chart version %q, appVersion %q", b, meta.Version, meta.AppVersion)
	}
	doc, _ := os.ReadFile(filepath.Join(dir, "docs", "install.md"))
	if !strings.Contains(string(doc), "\nharvester-csi/harvester-csi-driver:v1.2.3-rc.1\n") {
		t.Error("set-version did not update the image list of docs/install.md")
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestLicenseMatchesTheImageLabel: the repository's LICENSE is the license the image declares
// (org.opencontainers.image.licenses), as its full standard text.
func TestLicenseMatchesTheImageLabel(t *testing.T) {
	df, err := os.ReadFile(filepath.Join(render.RepoRoot(), "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`org\.opencontainers\.image\.licenses="([^"]+)"`).FindSubmatch(df)
	if m == nil {
		t.Fatal("the Dockerfile declares no org.opencontainers.image.licenses")
	}
	texts := map[string][]string{ // SPDX identifier: lines of its standard text
		"Apache-2.0": {"Apache License", "Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
			"9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"},
	}
	want, ok := texts[string(m[1])]
	if !ok {
		t.Fatalf("the image declares %q: add its standard text's markers here", m[1])
	}
	lic, err := os.ReadFile(filepath.Join(render.RepoRoot(), "LICENSE"))
	if err != nil {
		t.Fatalf("no LICENSE for the image's %s: %v", m[1], err)
	}
	for _, w := range want {
		if !strings.Contains(string(lic), w) {
			t.Errorf("LICENSE is not the %s text: no %q", m[1], w)
		}
	}
}

// TestChangelogHasTheVersion: CHANGELOG.md has a section for the version in VERSION.
func TestChangelogHasTheVersion(t *testing.T) {
	v := repoVersion(t)
	data, err := os.ReadFile(filepath.Join(render.RepoRoot(), "CHANGELOG.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^## ` + regexp.QuoteMeta(v) + `\b`).Match(data) {
		t.Errorf("CHANGELOG.md has no \"## %s\" section", v)
	}
}
