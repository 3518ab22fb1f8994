package host

import (
	"bytes"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

const module = "github.com/harvester-csi/harvester-csi-driver/"

// reader names code that reads decoded VMs and VMIs: a package, and in it
// only the files and the functions named (none: all of them).
type reader struct {
	pkg   string
	files []string
	funcs []string
}

// informerReaders is the code that reads the VM and VMI informers' objects.
// The other files of pkg/kubevirt read objects of live GETs, decoded in
// full.
var informerReaders = []reader{
	{pkg: "pkg/hotplug"},
	{pkg: "pkg/guest"},
	{pkg: "pkg/driver"},
	{pkg: "pkg/kubevirt", files: []string{"refusal.go", "declarative.go"}},
}

// holderCheckReaders is the code that reads the live lists (livelist.go):
// the queue's check of who holds a volume.
var holderCheckReaders = []reader{
	{pkg: "pkg/hotplug", files: []string{"write.go", "observed.go"}, funcs: []string{"liveHolders", "vmClaims", "vmiClaims", "appendClaims"}},
}

// methodReads says which fields a KubeVirt method the readers call reads.
// ObjectMeta's getters read the field they name.
var methodReads = map[string][]string{
	"kubevirt.io/api/core/v1.VirtualMachineInstance.IsFinal()": {
		"kubevirt.io/api/core/v1.VirtualMachineInstance.Status",
		"kubevirt.io/api/core/v1.VirtualMachineInstanceStatus.Phase",
	},
}

// The lean types must hold every field the informers' readers read: a
// field they drop reads as empty, and the reader decides on nothing. And
// they hold no more than that (the metadata aside), or the decoding costs
// more than it needs to.
func TestLeanTypesKeepEveryFieldTheReadersRead(t *testing.T) {
	kept, read := keptFields(t), readFields(t, informerReaders)
	checkReadIsKept(t, kept, read, "the informers' lean types (pkg/host/lean.go)")
	for _, k := range slices.Sorted(mapsKeys(kept)) {
		if _, ok := read[k]; !ok && !strings.HasPrefix(k, "k8s.io/apimachinery/pkg/apis/meta/v1.ObjectMeta.") {
			t.Errorf("the lean types decode %s, which no reader of the informers reads: drop it", k)
		}
	}
}

// The same for the live lists and the holder check that reads them, one
// way only: the live lists take whole volume parts of the lean types, a few
// small fields more than the check reads, to decode them with the same
// code.
func TestLiveListsKeepEveryFieldTheHolderCheckReads(t *testing.T) {
	checkReadIsKept(t, holdersKeptFields(t), readFields(t, holderCheckReaders), "the live lists (pkg/host/livelist.go)")
}

func checkReadIsKept(t *testing.T, kept map[string]bool, read map[string]string, types string) {
	t.Helper()
	for _, k := range slices.Sorted(mapsKeys(read)) {
		if _, ok := kept[k]; !ok {
			t.Errorf("%s reads %s, which %s do not decode: add it there", read[k], k, types)
		}
	}
}

func mapsKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

func fieldKey(owner reflect.Type, f string) string {
	return owner.PkgPath() + "." + owner.Name() + "." + f
}

// keptFields maps the fields of the kubevirtv1 VM and VMI that the lean
// types fill, as "pkgpath.Type.Field", to whether the whole value is kept
// (false: only the fields below it that are in the map).
func keptFields(t *testing.T) map[string]bool {
	t.Helper()
	return keptFieldsOf(t, reflect.TypeFor[leanVMI](), reflect.TypeFor[leanVM]())
}

// holdersKeptFields is keptFields of the live lists' types.
func holdersKeptFields(t *testing.T) map[string]bool {
	t.Helper()
	return keptFieldsOf(t, reflect.TypeFor[holdersVMI](), reflect.TypeFor[holdersVM]())
}

func keptFieldsOf(t *testing.T, vmi, vm reflect.Type) map[string]bool {
	t.Helper()
	kept := map[string]bool{}
	for _, p := range []struct{ lean, full reflect.Type }{
		{vmi, reflect.TypeFor[kubevirtv1.VirtualMachineInstance]()},
		{vm, reflect.TypeFor[kubevirtv1.VirtualMachine]()},
	} {
		if err := mapLean(p.lean, p.full, kept); err != nil {
			t.Fatal(err)
		}
	}
	return kept
}

func jsonName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
	return name
}

// mapLean pairs the fields of a lean struct with those of the kubevirtv1
// struct by JSON name, through the kubevirtv1 struct's inline embeddings.
func mapLean(lean, full reflect.Type, kept map[string]bool) error {
	for i := range lean.NumField() {
		lf := lean.Field(i)
		name := jsonName(lf)
		if name == "kind" {
			continue // read only to tell Status answers apart
		}
		path := findJSON(full, name)
		if path == nil {
			return fmt.Errorf("lean %s.%s: %s has no field %q", lean.Name(), lf.Name, full, name)
		}
		owner := full
		for _, step := range path[:len(path)-1] {
			kept[fieldKey(owner, step.Name)] = false
			owner = derefType(step.Type)
		}
		ff := path[len(path)-1]
		key := fieldKey(owner, ff.Name)
		lt, ft := lf.Type, ff.Type
		for lt.Kind() == ft.Kind() && (lt.Kind() == reflect.Pointer || lt.Kind() == reflect.Slice) {
			lt, ft = lt.Elem(), ft.Elem()
		}
		switch {
		case lt == ft:
			kept[key] = true
		case lt.Kind() == reflect.Struct && ft.Kind() == reflect.Struct:
			kept[key] = false
			if err := mapLean(lt, ft, kept); err != nil {
				return err
			}
		default:
			return fmt.Errorf("lean %s.%s is a %s, %s is a %s", lean.Name(), lf.Name, lf.Type, key, ff.Type)
		}
	}
	return nil
}

func derefType(t reflect.Type) reflect.Type {
	if t.Kind() == reflect.Pointer {
		return t.Elem()
	}
	return t
}

// findJSON returns the fields leading to the field of that JSON name:
// inline embeddings, then the field.
func findJSON(t reflect.Type, name string) []reflect.StructField {
	for i := range t.NumField() {
		f := t.Field(i)
		n := jsonName(f)
		if f.Anonymous && n == "" {
			if rest := findJSON(derefType(f.Type), name); rest != nil {
				return append([]reflect.StructField{f}, rest...)
			}
			continue
		}
		if n == name {
			return []reflect.StructField{f}
		}
	}
	return nil
}

// readFields type-checks the informers' readers and maps every field of a
// KubeVirt object they select (and the fields of the methods they call) to
// where the first such read is.
func readFields(t *testing.T, readers []reader) map[string]string {
	t.Helper()
	var paths []string
	for _, r := range readers {
		paths = append(paths, module+r.pkg)
	}
	pkgs, imp, fset := listPackages(t, paths)
	read := map[string]string{}
	for _, r := range readers {
		p := pkgs[module+r.pkg]
		var files []*ast.File
		for _, name := range p.GoFiles {
			f, err := parser.ParseFile(fset, filepath.Join(p.Dir, name), nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, f)
		}
		info := &types.Info{Selections: map[*ast.SelectorExpr]*types.Selection{}}
		conf := types.Config{Importer: imp}
		if _, err := conf.Check(p.ImportPath, fset, files, info); err != nil {
			t.Fatalf("type-check %s: %v", p.ImportPath, err)
		}
		inFuncs := funcRanges(files, r.funcs)
		for expr, sel := range info.Selections {
			pos := fset.Position(expr.Pos())
			if r.files != nil && !slices.Contains(r.files, filepath.Base(pos.Filename)) {
				continue
			}
			if r.funcs != nil && !inFuncs(expr.Pos()) {
				continue
			}
			for _, k := range selected(t, sel) {
				at := fmt.Sprintf("%s:%d", strings.TrimPrefix(pos.Filename, p.Dir+"/"), pos.Line)
				if prev, ok := read[k]; !ok || at < prev {
					read[k] = r.pkg + "/" + at
				}
			}
		}
	}
	return read
}

// funcRanges says whether a position lies in one of the named functions
// (methods included) of files.
func funcRanges(files []*ast.File, names []string) func(token.Pos) bool {
	var ranges [][2]token.Pos
	for _, f := range files {
		for _, d := range f.Decls {
			if fd, ok := d.(*ast.FuncDecl); ok && slices.Contains(names, fd.Name.Name) {
				ranges = append(ranges, [2]token.Pos{fd.Pos(), fd.End()})
			}
		}
	}
	return func(p token.Pos) bool {
		for _, r := range ranges {
			if p >= r[0] && p < r[1] {
				return true
			}
		}
		return false
	}
}

// selected lists the fields a selection on a KubeVirt type reads: each
// field it goes through, and for a method the fields methodReads names.
func selected(t *testing.T, sel *types.Selection) []string {
	named := namedOf(sel.Recv())
	if named == nil || named.Obj().Pkg() == nil || !strings.HasPrefix(named.Obj().Pkg().Path(), "kubevirt.io/api/") {
		return nil
	}
	var out []string
	typ := sel.Recv()
	idx := sel.Index()
	for i, fi := range idx {
		n := namedOf(typ)
		if i == len(idx)-1 && sel.Kind() != types.FieldVal {
			recv := namedOf(sel.Obj().(*types.Func).Signature().Recv().Type())
			m := typeKey(recv) + "." + sel.Obj().Name() + "()"
			if strings.HasPrefix(m, "k8s.io/apimachinery/pkg/apis/meta/v1.ObjectMeta.Get") {
				out = append(out, strings.TrimSuffix(strings.Replace(m, ".Get", ".", 1), "()"))
				continue
			}
			reads, ok := methodReads[m]
			if !ok {
				t.Errorf("a reader calls %s: say in methodReads which fields it reads", m)
			}
			out = append(out, reads...)
			continue
		}
		st, ok := typ.Underlying().(*types.Struct)
		if p, isPtr := typ.Underlying().(*types.Pointer); isPtr {
			st, ok = p.Elem().Underlying().(*types.Struct)
		}
		if !ok || n == nil {
			t.Fatalf("selection %s goes through %s, not a named struct", sel, typ)
		}
		f := st.Field(fi)
		out = append(out, typeKey(n)+"."+f.Name())
		typ = f.Type()
	}
	return out
}

func namedOf(t types.Type) *types.Named {
	if p, ok := t.(*types.Pointer); ok {
		t = p.Elem()
	}
	n, _ := types.Unalias(t).(*types.Named)
	return n
}

func typeKey(n *types.Named) string {
	return n.Obj().Pkg().Path() + "." + n.Obj().Name()
}

type listedPackage struct {
	ImportPath, Dir, Export string
	GoFiles                 []string
}

// listPackages asks the go command for the packages' files and for the
// compiled export data of everything they import, which the type checker
// reads instead of type-checking the dependencies from source.
func listPackages(t *testing.T, paths []string) (map[string]listedPackage, types.Importer, *token.FileSet) {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to list the readers' packages")
	}
	cmd := exec.Command(goBin, append([]string{"list", "-export", "-deps", "-json=ImportPath,Dir,Export,GoFiles"}, paths...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v: %s", err, stderr.String())
	}
	pkgs := map[string]listedPackage{}
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p listedPackage
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		pkgs[p.ImportPath] = p
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		p, ok := pkgs[path]
		if !ok || p.Export == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(p.Export)
	})
	return pkgs, imp, fset
}

// The map the test checks against is built from the lean types themselves:
// make sure it sees through KubeVirt's inline embeddings to the fields
// readers name.
func TestKeptFieldsFollowInlineEmbeddings(t *testing.T) {
	kept := keptFields(t)
	for _, k := range []string{
		"kubevirt.io/api/core/v1.Volume.VolumeSource",
		"kubevirt.io/api/core/v1.PersistentVolumeClaimVolumeSource.PersistentVolumeClaimVolumeSource",
		"k8s.io/api/core/v1.PersistentVolumeClaimVolumeSource.ClaimName",
		"kubevirt.io/api/core/v1.VirtualMachineInstance.ObjectMeta",
	} {
		if _, ok := kept[k]; !ok {
			t.Errorf("%s not in the kept fields", k)
		}
	}
	if whole := kept[fieldKey(reflect.TypeFor[metav1.ObjectMeta](), "Labels")]; !whole {
		t.Error("labels are kept whole")
	}
	if _, ok := kept[fieldKey(reflect.TypeFor[metav1.ObjectMeta](), "ManagedFields")]; ok {
		t.Error("managedFields are kept")
	}
}
