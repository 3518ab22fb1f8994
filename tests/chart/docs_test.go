package chart

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"unicode"

	"sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// userDocs are the documents an operator reads.
func userDocs(t *testing.T) map[string]string {
	t.Helper()
	root := render.RepoRoot()
	files, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, filepath.Join(root, "README.md"), filepath.Join(render.ChartDir(), "README.md"),
		filepath.Join(render.ChartDir(), "app-readme.md"), filepath.Join(render.ChartDir(), "values.yaml"),
		filepath.Join(render.ChartDir(), "questions.yaml"), filepath.Join(render.ChartDir(), "templates", "NOTES.txt"))
	out := map[string]string{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, f)
		out[rel] = string(b)
	}
	return out
}

func readDoc(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(render.RepoRoot(), rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// section is the text of a markdown section, from its heading to the next
// heading of the same or a higher level.
func section(t *testing.T, doc, heading string) string {
	t.Helper()
	_, rest, ok := strings.Cut(doc, "\n"+heading+"\n")
	if !ok {
		t.Fatalf("no section %q", heading)
	}
	level := strings.Count(strings.Fields(heading)[0], "#")
	fenced, end := false, len(rest)
	offset := 0
	for _, line := range strings.SplitAfter(rest, "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
		}
		if h := strings.Fields(line); !fenced && len(h) > 0 && strings.HasPrefix(line, "#") && strings.Trim(h[0], "#") == "" && len(h[0]) <= level {
			end = offset
			break
		}
		offset += len(line)
	}
	return rest[:end]
}

// TestDocsListEveryImage: the image list an air-gapped site mirrors from
// (docs/install.md) is exactly what the chart deploys with default values.
func TestDocsListEveryImage(t *testing.T) {
	sec := section(t, readDoc(t, filepath.Join("docs", "install.md")), "## Images")
	_, block, ok := strings.Cut(sec, "```text\n")
	if !ok {
		t.Fatal("docs/install.md: no ```text block of images under ## Images")
	}
	block, _, _ = strings.Cut(block, "```")
	listed := strings.Fields(block)
	want, err := render.Images(loadChart(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(listed, want) {
		t.Errorf("docs/install.md lists the images\n  %s\nthe chart deploys\n  %s", strings.Join(listed, "\n  "), strings.Join(want, "\n  "))
	}
}

// valuePath reports whether a dotted path ("a.b.c", "*" for any key) exists
// in the chart's values.
func valuePath(vals map[string]interface{}, path string) (interface{}, bool) {
	var cur interface{} = vals
	for _, k := range strings.Split(path, ".") {
		m, ok := cur.(map[string]interface{})
		if !ok {
			return nil, false
		}
		if k == "*" {
			return m, len(m) > 0
		}
		if cur, ok = m[k]; !ok {
			return nil, false
		}
	}
	return cur, true
}

// TestDocsNameRealValues: every chart value the user documents name (a
// backticked dotted path starting with a top-level key of values.yaml)
// exists, and the defaults in docs/install.md's values table are the chart's.
func TestDocsNameRealValues(t *testing.T) {
	vals := renderSet(t, valueSet{name: "default"}).eff
	token := regexp.MustCompile("`([a-zA-Z][a-zA-Z0-9]*(?:\\.[a-zA-Z0-9*]+)+)(?:=[^`]*)?`")
	for name, text := range userDocs(t) {
		for _, m := range token.FindAllStringSubmatch(text, -1) {
			path := m[1]
			top, _, _ := strings.Cut(path, ".")
			// Chart values are lowerCamelCase; a capital names Go code
			// (hotplug.Queue.DetachBefore), not a value.
			goName := regexp.MustCompile(`\.[A-Z]`).MatchString(path)
			if _, isValue := vals[top]; !isValue || goName || top == "global" && !strings.HasPrefix(path, "global.cattle.") {
				continue
			}
			if _, ok := valuePath(vals, path); !ok {
				t.Errorf("%s names the value %s, which values.yaml does not have", name, path)
			}
		}
	}

	table := section(t, readDoc(t, filepath.Join("docs", "install.md")), "## With Helm")
	rows := 0
	for _, line := range strings.Split(table, "\n") {
		cells := strings.Split(strings.Trim(strings.TrimSpace(line), "|"), "|")
		if len(cells) != 3 || !strings.HasPrefix(strings.TrimSpace(cells[0]), "`") {
			continue
		}
		path := strings.Trim(strings.TrimSpace(cells[0]), "`")
		doc := strings.TrimSpace(cells[1])
		if !strings.HasPrefix(doc, "`") {
			t.Errorf("docs/install.md values table: %s: default %q is not one `value`", path, doc)
			continue
		}
		var documented interface{}
		if err := yaml.Unmarshal([]byte(strings.Trim(doc, "`")), &documented); err != nil {
			t.Fatal(err)
		}
		got, ok := valuePath(vals, path)
		if !ok {
			t.Errorf("docs/install.md values table: %s is not a value", path)
			continue
		}
		rows++
		if sprint(normalizeNumber(got)) != sprint(normalizeNumber(documented)) {
			t.Errorf("docs/install.md values table: %s defaults to %v, values.yaml says %v", path, documented, got)
		}
	}
	if rows < 15 {
		t.Errorf("found only %d rows in docs/install.md's values table", rows)
	}
}

// normalizeNumber makes YAML integers and floats compare equal.
func normalizeNumber(v interface{}) interface{} {
	switch n := v.(type) {
	case int:
		return float64(n)
	case int64:
		return float64(n)
	case float64:
		return n
	}
	if v == nil {
		return ""
	}
	return v
}

// registeredMetrics are the metric names the driver registers: the literal
// names (Prometheus names are literals) in the shipped code, pkg/ and the
// command.
func registeredMetrics(t *testing.T) []string {
	t.Helper()
	var out []string
	name := regexp.MustCompile(`(?:NewDesc\(|Name:\s*)"(harvester_csi_[a-z0-9_]+)"`)
	for _, src := range goSources(t, "pkg", filepath.Join("cmd", "harvester-csi-driver")) {
		for _, m := range name.FindAllStringSubmatch(src, -1) {
			out = append(out, m[1])
		}
	}
	if len(out) < 5 {
		t.Fatalf("found only %v in the driver's code", out)
	}
	sort.Strings(out)
	return slices.Compact(out)
}

// TestDocsNameRealMetrics: every harvester_csi_* metric a document names is one
// the driver registers, and docs/architecture.md's metrics table lists them all.
func TestDocsNameRealMetrics(t *testing.T) {
	registered := registeredMetrics(t)
	name := regexp.MustCompile(`harvester_csi_[a-z0-9_]+`)
	for doc, text := range userDocs(t) {
		for _, m := range name.FindAllString(text, -1) {
			if !slices.Contains(registered, m) {
				t.Errorf("%s names the metric %s, which the driver does not register (it has %v)", doc, m, registered)
			}
		}
	}
	table := section(t, readDoc(t, filepath.Join("docs", "architecture.md")), "## Metrics")
	for _, m := range registered {
		if !strings.Contains(table, "`"+m) {
			t.Errorf("docs/architecture.md's metrics table does not explain %s", m)
		}
	}
	// The chart's own description of what the driver exports: the comment
	// above `metrics:` in values.yaml.
	values := readDoc(t, filepath.Join("charts", "harvester-csi-driver", "values.yaml"))
	before, _, ok := strings.Cut(values, "\nmetrics:\n")
	if !ok {
		t.Fatal("values.yaml has no metrics: key")
	}
	lines := strings.Split(before, "\n")
	var comment []string
	for i := len(lines) - 1; i >= 0 && strings.HasPrefix(lines[i], "#"); i-- {
		comment = append(comment, lines[i])
	}
	if strings.Contains(strings.Join(comment, " "), "sweeper") {
		t.Errorf("values.yaml promises sweeper metrics; the driver registers only %v", registered)
	}
}

// TestDocsFlagsMatchTheBinary: the flags docs/architecture.md documents are
// exactly the flags the driver's --help lists.
func TestDocsFlagsMatchTheBinary(t *testing.T) {
	help := driverHelp(t)
	var inHelp []string
	for _, m := range regexp.MustCompile(`(?m)^\s+--([a-z][a-z0-9-]*)`).FindAllStringSubmatch(help, -1) {
		inHelp = append(inHelp, m[1])
	}
	cmdline := section(t, readDoc(t, filepath.Join("docs", "architecture.md")), "## Command line")
	var documented []string
	for _, m := range regexp.MustCompile("`--([a-z][a-z0-9-]*)").FindAllStringSubmatch(cmdline, -1) {
		if !slices.Contains(documented, m[1]) {
			documented = append(documented, m[1])
		}
	}
	sort.Strings(inHelp)
	sort.Strings(documented)
	if !slices.Equal(inHelp, documented) {
		t.Errorf("docs/architecture.md documents the flags\n  %v\nthe driver's --help lists\n  %v", documented, inHelp)
	}
}

// TestDocsUseNoInternalShorthand: references to notes kept outside the
// repository (numbered seeds, items, pitfalls or sections, a bare issue
// number) mean nothing to a user.
func TestDocsUseNoInternalShorthand(t *testing.T) {
	for doc, text := range userDocs(t) {
		for _, m := range shorthand(text) {
			t.Errorf("%s: internal shorthand %q", doc, m)
		}
	}
}

// TestGoCommentsUseNoInternalShorthand holds the comments of every Go file
// (tools/ excepted: those modules only pin upstream binaries) to the same
// rule as the docs: a comment states the fact or cites an upstream source.
func TestGoCommentsUseNoInternalShorthand(t *testing.T) {
	root := render.RepoRoot()
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && (d.Name() == "vendor" || strings.HasPrefix(d.Name(), ".") ||
				strings.HasPrefix(d.Name(), "_") || p == filepath.Join(root, "tools")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, p, nil, parser.ParseComments)
		if err != nil {
			return err
		}
		for _, cg := range f.Comments {
			for _, m := range shorthand(cg.Text()) {
				pos := fset.Position(cg.Pos())
				rel, _ := filepath.Rel(root, pos.Filename)
				t.Errorf("%s:%d: internal shorthand %q in a comment", rel, pos.Line, m)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

var (
	// internalNote matches numbered references into private notes.
	internalNote = regexp.MustCompile(`(?i)\bseed[-\s]?\d|\bseeds/|\bpitfall\s+\d|\bitems?\s+\d|§|\bshared\s+reference`)
	issueWord    = regexp.MustCompile(`(?i)\bissues?\s+#?\d+`)
	// hashRef is "#N" on its own; "owner/repo#N" has a word character before the '#'.
	hashRef = regexp.MustCompile(`(?:^|[^\w/&])(#\d+)\b`)
	// upstreamProjects may precede "issue N": the number then has a tracker.
	upstreamProjects = []string{"harvester", "kubevirt", "kubernetes", "longhorn", "rke2", "rancher", "helm",
		"csi-test", "external-attacher", "external-provisioner", "external-resizer", "external-snapshotter", "etcd"}
)

// shorthand lists text's references to notes outside the repository.
func shorthand(text string) []string {
	out := internalNote.FindAllString(text, -1)
	for _, loc := range issueWord.FindAllStringIndex(text, -1) {
		if rest := text[loc[1]:]; rest != "" && (rest[0] == '-' || unicode.IsLetter(rune(rest[0]))) {
			continue // the verb, as in "issues 90-day tokens"
		}
		if !namesTracker(lastWord(text[:loc[0]])) {
			out = append(out, text[loc[0]:loc[1]])
		}
	}
	for _, m := range hashRef.FindAllStringSubmatch(text, -1) {
		out = append(out, m[1])
	}
	return out
}

func lastWord(s string) string {
	s = strings.TrimRightFunc(s, unicode.IsSpace)
	return s[strings.LastIndexFunc(s, unicode.IsSpace)+1:]
}

// namesTracker: "owner/repo" or a known upstream project.
func namesTracker(word string) bool {
	word = strings.ToLower(strings.Trim(word, "([{\"'`*_"))
	return strings.Contains(word, "/") || slices.Contains(upstreamProjects, word)
}

func TestShorthand(t *testing.T) {
	for text, want := range map[string][]string{
		"the lab's workload (seed 002)":                 {"seed 0"},
		"Package lab runs the seed-002 workload":        {"seed-0"},
		"Item 6: a symlink":                             {"Item 6"},
		"the shared reference, §1.1":                    {"shared reference", "§"},
		"Targets of the lab benchmark (issue 9).":       {"issue 9"},
		"From issue 13; churn":                          {"issue 13"},
		"fixed in #42":                                  {"#42"},
		"the CronJob churn of Harvester issue 9761":     nil,
		"reproduces kubevirt\nissue 16937":              nil,
		"the workload of Harvester issue\n9761":         nil,
		"From issue\n13":                                {"issue\n13"},
		"(harvester issue 10588)":                       nil,
		"see harvester/harvester#9761":                  nil,
		"kubevirt/kubevirt issue 16937":                 nil,
		"hack/host-rbac.sh issues 90-day tokens":        nil,
		"Behaviour 5 of the package doc, 3 items to go": nil,
	} {
		if got := shorthand(text); !slices.Equal(got, want) {
			t.Errorf("shorthand(%q) = %q, want %q", text, got, want)
		}
	}
}
