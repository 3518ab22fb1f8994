package chart

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// TestDocsPackageTableMatchesTheTree: docs/architecture.md's package table is
// where a newcomer learns which folder does what, so every Go package of the
// repository (outside tools/) falls under a row, and every path a row names
// exists. A row names a folder and, by that, everything under it.
func TestDocsPackageTableMatchesTheTree(t *testing.T) {
	root := render.RepoRoot()
	named := tablePaths(section(t, readDoc(t, filepath.Join("docs", "architecture.md")), "## Packages"))
	if len(named) == 0 {
		t.Fatal("docs/architecture.md's package table names no folder")
	}
	for _, p := range named {
		if strings.HasSuffix(p, ".go") || strings.Contains(p, "*") {
			if m, _ := filepath.Glob(filepath.Join(root, p)); len(m) == 0 {
				t.Errorf("the package table names %s, which matches no file", p)
			}
			continue
		}
		if fi, err := os.Stat(filepath.Join(root, p)); err != nil || !fi.IsDir() {
			t.Errorf("the package table names %s, which is not a folder of the repository", p)
		}
	}
	for _, pkg := range goPackages(t, root) {
		if !covered(pkg, named) {
			t.Errorf("package %s is under no row of docs/architecture.md's package table", pkg)
		}
	}
}

// tablePaths reads the first column of a markdown table: backticked paths,
// with {a,b} expanded.
func tablePaths(table string) []string {
	var out []string
	code := regexp.MustCompile("`([^`]+)`")
	for _, line := range strings.Split(table, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 {
			continue
		}
		for _, m := range code.FindAllStringSubmatch(cells[1], -1) {
			out = append(out, expandBraces(m[1])...)
		}
	}
	return out
}

func expandBraces(p string) []string {
	open, end := strings.Index(p, "{"), strings.Index(p, "}")
	if open < 0 || end < open {
		return []string{p}
	}
	var out []string
	for _, alt := range strings.Split(p[open+1:end], ",") {
		out = append(out, expandBraces(p[:open]+alt+p[end+1:])...)
	}
	return out
}

// goPackages are the folders holding Go files, relative to root, without
// tools/ (pinned upstream modules) and hidden folders.
func goPackages(t *testing.T, root string) []string {
	t.Helper()
	seen := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() && rel != "." && (rel == "tools" || strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "vendor") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(p, ".go") {
			seen[filepath.ToSlash(filepath.Dir(rel))] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for p := range seen {
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

func covered(pkg string, named []string) bool {
	for _, n := range named {
		n = strings.TrimSuffix(strings.TrimSuffix(n, "/..."), "/")
		if strings.HasSuffix(n, ".go") || strings.Contains(n, "*") {
			n = filepath.ToSlash(filepath.Dir(n))
		}
		if pkg == n || strings.HasPrefix(pkg, n+"/") {
			return true
		}
	}
	return false
}
