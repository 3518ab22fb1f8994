package chart

import (
	"bytes"
	"go/ast"
	"go/constant"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/tests/chart/render"
)

// operatorDocs are the Markdown documents an operator copies commands from
// (README.md, docs/*.md and the chart's).
func operatorDocs(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for name, text := range userDocs(t) {
		if strings.HasSuffix(name, ".md") {
			out[name] = text
		}
	}
	return out
}

var (
	fence    = regexp.MustCompile("(?ms)^\\s*```[^\\n]*\\n(.*?)^\\s*```")
	codeSpan = regexp.MustCompile("`([^`]+)`")
)

// snippets are the code of a document: each line of a fenced block (with its
// `\` continuations joined) and each inline code span, which may run over a
// line break of the source.
func snippets(doc string) []string {
	var out []string
	for _, m := range fence.FindAllStringSubmatch(doc, -1) {
		joined := strings.ReplaceAll(m[1], "\\\n", " ")
		for _, line := range strings.Split(joined, "\n") {
			if line, _, _ = strings.Cut(line, " #"); strings.TrimSpace(line) != "" {
				out = append(out, strings.TrimSpace(line))
			}
		}
	}
	for _, m := range codeSpan.FindAllStringSubmatch(fence.ReplaceAllString(doc, ""), -1) {
		out = append(out, strings.Join(strings.Fields(m[1]), " "))
	}
	return out
}

// commands splits a snippet into its simple commands, each as its words
// (quotes removed; a quoted string stays one word).
func commands(snippet string) [][]string {
	var out [][]string
	for _, part := range regexp.MustCompile(`\|\||&&|[;|]|\$\(|\)`).Split(snippet, -1) {
		var words []string
		var cur strings.Builder
		quote := rune(0)
		for _, r := range part {
			switch {
			case quote != 0 && r == quote:
				quote = 0
			case quote != 0:
				cur.WriteRune(r)
			case r == '"' || r == '\'':
				quote = r
			case r == ' ' || r == '\t':
				if cur.Len() > 0 {
					words = append(words, cur.String())
					cur.Reset()
				}
			default:
				cur.WriteRune(r)
			}
		}
		if cur.Len() > 0 {
			words = append(words, cur.String())
		}
		// Environment assignments before the command (SRC=... hack/x.sh).
		for len(words) > 0 && regexp.MustCompile(`^[A-Z_]+=`).MatchString(words[0]) {
			words = words[1:]
		}
		// kubectl exec ... -- COMMAND: the command after "--" is checked too.
		if i := slices.Index(words, "--"); i >= 0 {
			out = append(out, commands(strings.Join(words[i+1:], " "))...)
			words = words[:i]
		}
		if len(words) > 0 {
			out = append(out, words)
		}
	}
	return out
}

// flagsOf are the long options among words ("--name" of "--name=value").
func flagsOf(words []string) []string {
	var out []string
	for _, w := range words {
		if m := regexp.MustCompile(`^--([a-z][a-z0-9-]*)`).FindStringSubmatch(w); m != nil {
			out = append(out, m[1])
		}
	}
	return out
}

// accepts: whether a program with the flags have takes --f (every program
// here answers --help).
func accepts(have []string, f string) bool { return f == "help" || slices.Contains(have, f) }

// helpFlags are the flags a Go program's help text lists ("  --name" or Go's
// flag package's "  -name").
func helpFlags(help string) []string {
	var out []string
	for _, m := range regexp.MustCompile(`(?m)^\s+--?([a-z][a-z0-9-]*)`).FindAllStringSubmatch(help, -1) {
		out = append(out, m[1])
	}
	return out
}

var (
	labHelpOnce sync.Once
	labHelpText string
	labHelpErr  string
)

// labHelp is hcsi-lab's --help, from a binary built into a temporary directory.
func labHelp(t *testing.T) string {
	t.Helper()
	labHelpOnce.Do(func() {
		dir, err := os.MkdirTemp("", "hcsi-lab-help")
		if err != nil {
			labHelpErr = err.Error()
			return
		}
		defer os.RemoveAll(dir)
		bin := filepath.Join(dir, "hcsi-lab")
		build := exec.Command("go", "build", "-o", bin, "./cmd/hcsi-lab")
		build.Dir = render.RepoRoot()
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			labHelpErr = "build hcsi-lab: " + err.Error() + "\n" + string(out)
			return
		}
		var out bytes.Buffer
		cmd := exec.Command(bin, "--help")
		cmd.Stdout, cmd.Stderr = &out, &out
		_ = cmd.Run() // --help exits non-zero
		labHelpText = out.String()
	})
	if labHelpErr != "" {
		t.Fatal(labHelpErr)
	}
	if !strings.Contains(labHelpText, "-quick") {
		t.Fatalf("unexpected hcsi-lab --help output:\n%s", labHelpText)
	}
	return labHelpText
}

// subcommandHelp is the help of `harvester-csi-driver <sub> --help`.
func subcommandHelp(t *testing.T, sub string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "harvester-csi-driver")
	build := exec.Command("go", "build", "-o", bin, "./cmd/harvester-csi-driver")
	build.Dir = render.RepoRoot()
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the driver: %v\n%s", err, out)
	}
	var out bytes.Buffer
	cmd := exec.Command(bin, sub, "--help")
	cmd.Stdout, cmd.Stderr = &out, &out
	_ = cmd.Run()
	return out.String()
}

// scriptUsage is a hack script's usage text: what `--help` prints for a
// script with a usage function (run only for those: it exits before doing
// anything), else its header comment.
func scriptUsage(t *testing.T, script string) string {
	t.Helper()
	path := filepath.Join(render.RepoRoot(), script)
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("a document names %s: %v", script, err)
	}
	if strings.Contains(string(src), "\nusage() {") {
		out, err := exec.Command("bash", path, "--help").CombinedOutput()
		if err != nil {
			t.Fatalf("%s --help: %v\n%s", script, err, out)
		}
		return string(out)
	}
	var header []string
	for _, line := range strings.Split(string(src), "\n")[1:] {
		if !strings.HasPrefix(line, "#") {
			break
		}
		header = append(header, line)
	}
	return strings.Join(header, "\n")
}

// makeTargets are the targets the Makefile defines.
func makeTargets(t *testing.T) []string {
	t.Helper()
	var out []string
	for _, m := range regexp.MustCompile(`(?m)^([a-z][a-zA-Z0-9_-]*):`).FindAllStringSubmatch(readDoc(t, "Makefile"), -1) {
		out = append(out, m[1])
	}
	return out
}

// kubectlKinds maps what kubectl accepts for the kinds the docs name to the
// kind.
var kubectlKinds = map[string]string{
	"deploy": "Deployment", "deployment": "Deployment", "deployments": "Deployment",
	"ds": "DaemonSet", "daemonset": "DaemonSet", "daemonsets": "DaemonSet",
	"sa": "ServiceAccount", "serviceaccount": "ServiceAccount", "serviceaccounts": "ServiceAccount",
	"secret": "Secret", "secrets": "Secret", "lease": "Lease", "leases": "Lease",
	"svc": "Service", "service": "Service", "services": "Service",
	"csidriver": "CSIDriver", "csidrivers": "CSIDriver",
	"storageclass": "StorageClass", "storageclasses": "StorageClass", "sc": "StorageClass",
	"volumesnapshotclass": "VolumeSnapshotClass", "volumesnapshotclasses": "VolumeSnapshotClass",
}

var clusterScoped = map[string]bool{"CSIDriver": true, "StorageClass": true, "VolumeSnapshotClass": true}

// guestObjects are the objects of the guest cluster the docs may name: what
// the chart renders with default values, the host identity's Secret that
// hack/host-rbac.sh writes (its default name, from its usage text) and the
// guest node monitor's Lease. Keys are "Kind namespace/name".
func guestObjects(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	r := renderSet(t, valueSet{name: "default"})
	for _, o := range r.objects {
		ns := o.GetNamespace()
		if ns == "" && !clusterScoped[o.GetKind()] {
			ns = "kube-system"
		}
		out[o.GetKind()+" "+ns+"/"+o.GetName()] = true
	}
	m := regexp.MustCompile(`--secret-name NAME.*\(default: ([a-z0-9-]+)\)`).FindStringSubmatch(scriptUsage(t, "hack/host-rbac.sh"))
	if m == nil {
		t.Fatal("hack/host-rbac.sh's usage names no default --secret-name")
	}
	out["Secret kube-system/"+m[1]] = true
	out["Lease kube-system/"+guest.DefaultLeaseName] = true
	return out
}

// containersOf are the container names of a rendered workload.
func containersOf(t *testing.T, kind, name string) []string {
	t.Helper()
	o := renderSet(t, valueSet{name: "default"}).find(kind, name)
	if o == nil {
		return nil
	}
	var out []string
	for _, key := range []string{"containers", "initContainers"} {
		list, _ := nested(t, o.Object, "spec", "template", "spec", key).([]interface{})
		for _, c := range list {
			out = append(out, c.(map[string]interface{})["name"].(string))
		}
	}
	return out
}

// kubectlNames are the guest objects a kubectl command names, as
// "Kind namespace/name", and the container it picks with -c (for the first
// workload). Commands against another cluster (a --kubeconfig, a namespace
// other than the release's) and placeholder names are not the chart's.
func kubectlNames(words []string) (objects []string, container string) {
	ns := ""
	var rest []string
	for i := 1; i < len(words); i++ {
		switch w := words[i]; {
		case w == "-n" || w == "--namespace":
			if i+1 < len(words) {
				ns = words[i+1]
				i++
			}
		case strings.HasPrefix(w, "--namespace="):
			ns = strings.TrimPrefix(w, "--namespace=")
		case w == "--kubeconfig" || w == "--context":
			return nil, ""
		case w == "-c" && i+1 < len(words):
			container = words[i+1]
			i++
		case w == "-o" || w == "-l" || w == "-p" || w == "--type":
			i++
		case strings.HasPrefix(w, "-"):
		default:
			rest = append(rest, w)
		}
	}
	if ns != "" && ns != "kube-system" {
		return nil, ""
	}
	name := func(kind, n string) {
		if strings.ContainsAny(n, "<>") || n == "" {
			return
		}
		where := "kube-system"
		if clusterScoped[kind] {
			where = ""
		} else if ns == "" {
			return // the default namespace of whoever runs it: not the chart's
		}
		objects = append(objects, kind+" "+where+"/"+n)
	}
	for i, w := range rest {
		if k, n, ok := strings.Cut(w, "/"); ok {
			if kind, known := kubectlKinds[strings.ToLower(strings.SplitN(k, ".", 2)[0])]; known {
				name(kind, n)
			}
			continue
		}
		if kind, known := kubectlKinds[strings.ToLower(w)]; known && i > 0 && i+1 < len(rest) && !strings.Contains(rest[i+1], "/") {
			switch rest[i-1] {
			case "get", "describe", "delete", "edit", "logs", "exec":
				name(kind, rest[i+1])
			}
		}
	}
	return objects, container
}

// TestDocsNameRealThings: every command, object name, Make target and flag the
// README and docs/*.md give an operator exists: objects that kubectl commands
// and `kube-system/NAME` mentions name are the chart's (or the Secret and
// Lease the driver's tools make), containers picked with -c are the
// workload's, `make X` targets are the Makefile's, flags of
// harvester-csi-driver (and its diagnose subcommand) and hcsi-lab are in
// their --help, options of hack/*.sh in the script's usage text, and a flag
// named alone in prose belongs to one of those or to a tool listed below.
func TestDocsNameRealThings(t *testing.T) {
	driver := helpFlags(driverHelp(t))
	if len(driver) == 0 {
		t.Fatal("the driver's --help lists no flags")
	}
	diagnose := helpFlags(subcommandHelp(t, "diagnose"))
	lab := helpFlags(labHelp(t))
	targets := makeTargets(t)
	objects := guestObjects(t)
	scripts := map[string][]string{}
	scriptFlags := func(script string) []string {
		if _, ok := scripts[script]; !ok {
			scripts[script] = []string{}
			for _, m := range regexp.MustCompile(`--([a-z][a-z0-9-]*)`).FindAllStringSubmatch(scriptUsage(t, script), -1) {
				scripts[script] = append(scripts[script], m[1])
			}
		}
		return scripts[script]
	}
	allScripts, err := filepath.Glob(filepath.Join(render.RepoRoot(), "hack", "*.sh"))
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, f := range slices.Concat(driver, diagnose, lab) {
		known[f] = true
	}
	for _, s := range allScripts {
		for _, f := range scriptFlags("hack/" + filepath.Base(s)) {
			known[f] = true
		}
	}
	// Flags of other programs that the docs name in prose, by program.
	for _, f := range []string{
		"help",                                                                                                                          // every Go program here
		"exec",                                                                                                                          // tools/kubelet's hollow-kubelet
		"no-canonicalize",                                                                                                               // mount(8)
		"reconcile-sync", "worker-threads", "timeout", "leader-election", "http-endpoint", "retry-interval-start", "retry-interval-max", // CSI sidecars
		"service-account-max-token-expiration",                        // kube-apiserver
		"set", "reset-then-reuse-values", "reuse-values", "namespace", // helm
		"all", // skopeo copy
	} {
		known[f] = true
	}

	seen := map[string]int{}
	for doc, text := range operatorDocs(t) {
		for _, snip := range snippets(text) {
			if strings.HasPrefix(snip, "--") {
				for _, f := range flagsOf(strings.Fields(snip)) {
					if !known[f] {
						t.Errorf("%s: `%s` names the flag --%s, which no program of this repository (nor a tool the docs use) has", doc, snip, f)
					}
				}
			}
			for _, m := range regexp.MustCompile(`^kube-system/([a-z0-9.-]+)$`).FindAllStringSubmatch(snip, -1) {
				found := false
				for o := range objects {
					found = found || strings.HasSuffix(o, " kube-system/"+m[1])
				}
				if !found {
					t.Errorf("%s: `%s` is no object of the chart, nor the Secret or Lease the driver's tools make", doc, snip)
				}
			}
			for _, words := range commands(snip) {
				prog := filepath.Base(words[0])
				seen[prog]++
				switch {
				case strings.HasPrefix(words[0], "hack/") && strings.HasSuffix(prog, ".sh"):
					for _, f := range flagsOf(words[1:]) {
						if !accepts(scriptFlags(words[0]), f) {
							t.Errorf("%s: `%s`: %s has no option --%s (its usage: %v)", doc, snip, words[0], f, scriptFlags(words[0]))
						}
					}
				case prog == "harvester-csi-driver":
					have, what := driver, "--help"
					if len(words) > 1 && words[1] == "diagnose" {
						have, what = diagnose, "diagnose --help"
					}
					for _, f := range flagsOf(words[1:]) {
						if !accepts(have, f) {
							t.Errorf("%s: `%s`: harvester-csi-driver %s lists no --%s", doc, snip, what, f)
						}
					}
				case prog == "hcsi-lab":
					for _, f := range flagsOf(words[1:]) {
						if !accepts(lab, f) {
							t.Errorf("%s: `%s`: hcsi-lab --help lists no --%s", doc, snip, f)
						}
					}
				case prog == "make":
					for _, w := range words[1:] {
						if v, ok := strings.CutPrefix(w, "LAB_FLAGS="); ok {
							for _, f := range flagsOf(strings.Fields(v)) {
								if !accepts(lab, f) {
									t.Errorf("%s: `%s`: hcsi-lab --help lists no --%s", doc, snip, f)
								}
							}
						}
						if !strings.ContainsAny(w, "=-<") && !slices.Contains(targets, w) {
							t.Errorf("%s: `%s`: the Makefile has no target %q", doc, snip, w)
						}
					}
				case prog == "kubectl":
					names, container := kubectlNames(words)
					for _, o := range names {
						if !objects[o] {
							t.Errorf("%s: `%s` names %s, which the chart does not make (it makes %v)", doc, snip, o, sortedKeys(objects))
						}
					}
					if container != "" && len(names) > 0 {
						kind, name, _ := strings.Cut(names[0], " ")
						_, name, _ = strings.Cut(name, "/")
						if have := containersOf(t, kind, name); !slices.Contains(have, container) {
							t.Errorf("%s: `%s`: %s has no container %q (it has %v)", doc, snip, names[0], container, have)
						}
					}
				}
			}
		}
	}
	checkedEnough(t, seen)
}

// checkedEnough fails a run that found too few commands of a kind to have
// checked anything: the parsing, not the docs, would be wrong.
func checkedEnough(t *testing.T, seen map[string]int) {
	t.Helper()
	for _, prog := range []string{"host-rbac.sh", "harvester-csi-driver", "hcsi-lab", "make", "kubectl", "helm"} {
		if seen[prog] == 0 {
			t.Errorf("found no %s command in the docs: the snippets were not parsed (found %v)", prog, seen)
		}
	}
}

// eventReasons are the reasons the driver's code gives the Events it writes:
// in every call whose callee's name mentions "event" or "record" (an
// EventRecorder's Event, the driver's own Event sinks), the argument after
// the Event type (corev1.EventTypeNormal/Warning or a value named like it).
// A reason is a string literal, a constant, or a local variable, whose
// every string assignment in the function counts.
func eventReasons(t *testing.T) []string {
	t.Helper()
	fset := token.NewFileSet()
	type file struct {
		f   *ast.File
		pkg string
	}
	var files []file
	consts := map[string]string{} // constant name (also package.Name) → value
	for _, dir := range []string{"pkg", filepath.Join("cmd", "harvester-csi-driver")} {
		err := filepath.WalkDir(filepath.Join(render.RepoRoot(), dir), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, p, nil, 0)
			if err != nil {
				return err
			}
			files = append(files, file{f, f.Name.Name})
			for _, decl := range f.Decls {
				gd, ok := decl.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, spec := range gd.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if i < len(vs.Values) {
							if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
								v := constant.StringVal(constant.MakeFromLiteral(lit.Value, lit.Kind, 0))
								consts[n.Name], consts[f.Name.Name+"."+n.Name] = v, v
							}
						}
					}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	isEventType := func(e ast.Expr) bool {
		switch x := e.(type) {
		case *ast.SelectorExpr:
			return strings.HasPrefix(x.Sel.Name, "EventType")
		case *ast.Ident:
			return strings.HasPrefix(x.Name, "EventType") || x.Name == "eventType"
		}
		return false
	}
	var out []string
	add := func(fn *ast.FuncDecl, e ast.Expr) {
		switch x := e.(type) {
		case *ast.BasicLit:
			if v, err := strconv.Unquote(x.Value); err == nil {
				out = append(out, v)
			}
		case *ast.SelectorExpr:
			if pkg, ok := x.X.(*ast.Ident); ok && consts[pkg.Name+"."+x.Sel.Name] != "" {
				out = append(out, consts[pkg.Name+"."+x.Sel.Name])
			}
		case *ast.Ident:
			if v, ok := consts[x.Name]; ok {
				out = append(out, v)
				return
			}
			// A local variable: every string literal or constant assigned
			// to it in the function.
			ast.Inspect(fn, func(n ast.Node) bool {
				as, ok := n.(*ast.AssignStmt)
				if !ok || len(as.Lhs) != len(as.Rhs) {
					return true
				}
				for i, l := range as.Lhs {
					if id, ok := l.(*ast.Ident); ok && id.Name == x.Name {
						switch r := as.Rhs[i].(type) {
						case *ast.BasicLit:
							if v, err := strconv.Unquote(r.Value); err == nil {
								out = append(out, v)
							}
						case *ast.Ident:
							if v, ok := consts[r.Name]; ok {
								out = append(out, v)
							}
						}
					}
				}
				return true
			})
		}
	}
	for _, f := range files {
		for _, decl := range f.f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				var name string
				switch c := call.Fun.(type) {
				case *ast.SelectorExpr:
					name = c.Sel.Name
				case *ast.Ident:
					name = c.Name
				}
				lower := strings.ToLower(name)
				if !strings.Contains(lower, "event") && !strings.Contains(lower, "record") {
					return true
				}
				for i := 0; i+1 < len(call.Args); i++ {
					if isEventType(call.Args[i]) {
						add(fn, call.Args[i+1])
						break
					}
				}
				return true
			})
		}
	}
	sort.Strings(out)
	return slices.Compact(out)
}

// TestDocsListEveryEventReason: the Event reasons docs/troubleshooting.md
// lists where it says where the driver reports things are exactly those the
// code writes, and every reason a document gives an Event ("Event `X`",
// "reason `X`", "`X` event") is one the code writes (or kubelet's
// FailedAttachVolume, which the docs point to).
func TestDocsListEveryEventReason(t *testing.T) {
	written := eventReasons(t)
	// The sinks of pkg/driver, pkg/guest and the node sweeper: a parser that
	// lost them would pass with nothing to compare.
	for _, want := range []string{"HotplugWaiting", "VolumeDetachForced", "StaleStagingMountRemoved"} {
		if !slices.Contains(written, want) {
			t.Fatalf("found the Event reasons %v in the code, not %s", written, want)
		}
	}
	reason := regexp.MustCompile("`([A-Z][a-z]+(?:[A-Z][a-z]*)+)`")
	sec := section(t, readDoc(t, filepath.Join("docs", "troubleshooting.md")), "## Where the driver says things")
	var listed []string
	for _, line := range strings.Split(sec, "\n- ") {
		if !strings.Contains(line, "Events on") {
			continue
		}
		for _, m := range reason.FindAllStringSubmatch(line, -1) {
			listed = append(listed, m[1])
		}
	}
	sort.Strings(listed)
	listed = slices.Compact(listed)
	if !slices.Equal(listed, written) {
		t.Errorf("docs/troubleshooting.md's \"Events on ...\" items list the reasons\n  %v\nthe driver writes\n  %v", listed, written)
	}
	kubernetes := []string{"FailedAttachVolume"}
	mention := regexp.MustCompile("(?:Events?|reason) `([A-Za-z]+)`|`([A-Za-z]+)` [Ee]vents?\\b")
	for doc, text := range userDocs(t) {
		for _, m := range mention.FindAllStringSubmatch(strings.Join(strings.Fields(text), " "), -1) {
			r := m[1] + m[2]
			if r == "Normal" || r == "Warning" || slices.Contains(kubernetes, r) {
				continue
			}
			if !slices.Contains(written, r) {
				t.Errorf("%s names the Event reason %s, which the driver never writes (it writes %v)", doc, r, written)
			}
		}
	}
}
