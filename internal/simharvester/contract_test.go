package simharvester_test

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/simharvester"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// One API server with KubeVirt's VM API for the package; the webhook
// configurations have fixed names, so the tests run one server at a time.
var env *testenv.Env

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	var err error
	env, err = testenv.Start(ctx, testenv.Options{})
	if err == nil {
		err = installAPIs(ctx, env)
	}
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "simharvester tests: cannot start the API server:", err)
		if env != nil {
			env.Stop()
		}
		os.Exit(1)
	}
	code := m.Run()
	env.Stop()
	os.Exit(code)
}

// installAPIs installs a VirtualMachine CRD with its status subresource
// (the webhook's rules name both) and the two classes the rules tell apart.
func installAPIs(ctx context.Context, env *testenv.Env) error {
	ext, err := apiextclient.NewForConfig(env.Config)
	if err != nil {
		return err
	}
	vmCRD := &apiextv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "virtualmachines.kubevirt.io"},
		Spec: apiextv1.CustomResourceDefinitionSpec{
			Group: "kubevirt.io", Scope: apiextv1.NamespaceScoped,
			Names: apiextv1.CustomResourceDefinitionNames{Plural: "virtualmachines", Singular: "virtualmachine", Kind: "VirtualMachine", ListKind: "VirtualMachineList"},
			Versions: []apiextv1.CustomResourceDefinitionVersion{{
				Name: "v1", Served: true, Storage: true,
				Schema:       &apiextv1.CustomResourceValidation{OpenAPIV3Schema: &apiextv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr.To(true)}},
				Subresources: &apiextv1.CustomResourceSubresources{Status: &apiextv1.CustomResourceSubresourceStatus{}},
			}},
		},
	}
	if err := testenv.InstallCRDs(ctx, ext, []*apiextv1.CustomResourceDefinition{vmCRD}); err != nil {
		return err
	}
	kube, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		return err
	}
	for name, prov := range map[string]string{"longhorn": "driver.longhorn.io", "nfs": "nfs.csi.k8s.io"} {
		sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: prov}
		if _, err := kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

type fixture struct {
	ctx  context.Context
	kube kubernetes.Interface
	kv   kubevirt.Interface
	ns   string
	srv  *simharvester.Server
}

var nsSeq int

// start gives a test its namespace; the objects made before serve exist
// before the webhooks do (as on a cluster where two VMs already share a
// claim).
func start(t *testing.T) *fixture {
	t.Helper()
	if testing.Short() {
		t.Skip("needs an API server")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	f := &fixture{ctx: ctx}
	var err error
	if f.kube, err = kubernetes.NewForConfig(env.Config); err != nil {
		t.Fatal(err)
	}
	if f.kv, err = kubevirt.NewForConfig(env.Config); err != nil {
		t.Fatal(err)
	}
	nsSeq++
	f.ns = fmt.Sprintf("hv-%d", nsSeq)
	if _, err := f.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: f.ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fixture) serve(t *testing.T, r simharvester.Release) {
	t.Helper()
	srv, err := simharvester.Start(f.ctx, env.Config, simharvester.Options{Release: r})
	if err != nil {
		t.Fatal(err)
	}
	f.srv = srv
	t.Cleanup(srv.Stop)
}

func (f *fixture) pvc(t *testing.T, name, class string, mode corev1.PersistentVolumeAccessMode) {
	t.Helper()
	p := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: f.ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{mode},
			StorageClassName: &class,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := f.kube.CoreV1().PersistentVolumeClaims(f.ns).Create(f.ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// vm makes a VM whose template has these claims as hot-plugged volumes on
// non-shareable disks (a claim ending in "+shared": on a shareable disk).
func vmObject(ns, name string, claims ...string) *kubevirtv1.VirtualMachine {
	vm := &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
			Spec: kubevirtv1.VirtualMachineInstanceSpec{TerminationGracePeriodSeconds: ptr.To[int64](30)},
		}},
	}
	for _, c := range claims {
		shared := strings.HasSuffix(c, "+shared")
		c = strings.TrimSuffix(c, "+shared")
		vm.Spec.Template.Spec.Volumes = append(vm.Spec.Template.Spec.Volumes, kubevirtv1.Volume{Name: c, VolumeSource: kubevirtv1.VolumeSource{
			PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: c}, Hotpluggable: true}}})
		d := kubevirtv1.Disk{Name: c, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}}
		if shared {
			d.Shareable = ptr.To(true)
		}
		vm.Spec.Template.Spec.Domain.Devices.Disks = append(vm.Spec.Template.Spec.Domain.Devices.Disks, d)
	}
	return vm
}

func (f *fixture) createVM(name string, claims ...string) error {
	_, err := f.kv.KubevirtV1().VirtualMachines(f.ns).Create(f.ctx, vmObject(f.ns, name, claims...), metav1.CreateOptions{})
	return err
}

// label is a spec write that touches no volume.
func (f *fixture) label(name string) error {
	_, err := f.kv.KubevirtV1().VirtualMachines(f.ns).Patch(f.ctx, name, types.MergePatchType, []byte(`{"metadata":{"labels":{"touched":"yes"}}}`), metav1.PatchOptions{})
	return err
}

// statusWrite is a write of the status subresource, as KubeVirt's VM
// controller makes.
func (f *fixture) statusWrite(name string) error {
	_, err := f.kv.KubevirtV1().VirtualMachines(f.ns).Patch(f.ctx, name, types.MergePatchType, []byte(`{"status":{"printableStatus":"Running"}}`), metav1.PatchOptions{}, "status")
	return err
}

func (f *fixture) setClaims(name string, claims ...string) error {
	vm, err := f.kv.KubevirtV1().VirtualMachines(f.ns).Get(f.ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	want := vmObject(f.ns, name, claims...)
	vm.Spec.Template.Spec.Volumes = want.Spec.Template.Spec.Volumes
	vm.Spec.Template.Spec.Domain.Devices.Disks = want.Spec.Template.Spec.Domain.Devices.Disks
	_, err = f.kv.KubevirtV1().VirtualMachines(f.ns).Update(f.ctx, vm, metav1.UpdateOptions{})
	return err
}

// wantDenied checks a refusal by Harvester's validator: its webhook's name,
// the exact message and code.
func wantDenied(t *testing.T, what string, err error, code int32, msg string) {
	t.Helper()
	want := `admission webhook "` + simharvester.ValidatorName + `" denied the request: ` + msg
	st, ok := err.(apierrors.APIStatus)
	if !ok {
		t.Errorf("%s: got %v, want the refusal %q", what, err, want)
		return
	}
	if st.Status().Code != code || err.Error() != want {
		t.Errorf("%s: got %d %q, want %d %q", what, st.Status().Code, err.Error(), code, want)
	}
}

func wantAllowed(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Errorf("%s: %v", what, err)
	}
}

func occupiedMessage(r simharvester.Release, ns, claim, otherVM string) string {
	if r == simharvester.V1_6 {
		return fmt.Sprintf("the volume %s is already used by VM %s/%s", claim, ns, otherVM)
	}
	return fmt.Sprintf("PVC %s/%s is already used by other VM, please use a shareable RWX volume.", ns, claim)
}

var releases = []simharvester.Release{simharvester.V1_6, simharvester.V1_7, simharvester.V1_8}

// A claim in two VMs' templates: every write of either VM that keeps it is
// refused, spec and status alike; the write that drops it passes, and then
// both VMs can be written again. A third VM cannot take the claim.
func TestSharedClaimFreezesBothVMs(t *testing.T) {
	for _, r := range releases {
		t.Run(string(r), func(t *testing.T) {
			f := start(t)
			f.pvc(t, "pvc-a", "longhorn", corev1.ReadWriteMany) // the driver's host claims: RWX in Longhorn
			f.pvc(t, "pvc-b", "longhorn", corev1.ReadWriteMany)
			if err := f.createVM("vm-1", "pvc-a"); err != nil {
				t.Fatal(err)
			}
			if err := f.createVM("vm-2", "pvc-b", "pvc-a"); err != nil {
				t.Fatal(err)
			}
			f.serve(t, r)

			wantDenied(t, "spec write of vm-1", f.label("vm-1"), http.StatusUnprocessableEntity, occupiedMessage(r, f.ns, "pvc-a", "vm-2"))
			wantDenied(t, "status write of vm-1", f.statusWrite("vm-1"), http.StatusUnprocessableEntity, occupiedMessage(r, f.ns, "pvc-a", "vm-2"))
			wantDenied(t, "status write of vm-2", f.statusWrite("vm-2"), http.StatusUnprocessableEntity, occupiedMessage(r, f.ns, "pvc-a", "vm-1"))
			// Both VMs hold the claim; Harvester's index lookup returns them in
			// no set order (client-go's ByIndex walks a set), so either is named.
			third := f.createVM("vm-3", "pvc-a")
			if r != simharvester.V1_6 || !strings.Contains(fmt.Sprint(third), "VM "+f.ns+"/vm-2") {
				wantDenied(t, "a third VM taking the claim", third, http.StatusUnprocessableEntity, occupiedMessage(r, f.ns, "pvc-a", "vm-1"))
			} else {
				wantDenied(t, "a third VM taking the claim", third, http.StatusUnprocessableEntity, occupiedMessage(r, f.ns, "pvc-a", "vm-2"))
			}
			wantAllowed(t, "vm-2 dropping the claim", f.setClaims("vm-2", "pvc-b"))
			// The validator reads VMs from its cache, as Harvester's does.
			testwait.Until(f.ctx, t, "vm-1 writable once vm-2 let go", func() (bool, string) {
				err := f.label("vm-1")
				return err == nil, fmt.Sprint(err)
			})
			wantAllowed(t, "status write of vm-2", f.statusWrite("vm-2"))
		})
	}
}

// Which claims count: 1.6 counts every PVC volume; from 1.7 a claim on a
// shareable disk of the other VM, an RWX claim outside Longhorn and a
// claim that does not exist yet pass.
func TestWhichClaimsCount(t *testing.T) {
	cases := []struct {
		name        string
		holder      string // the other VM's template entry
		class       string // "": no claim
		mode        corev1.PersistentVolumeAccessMode
		deniedSince map[simharvester.Release]bool
	}{
		{"RWO Longhorn", "pvc-x", "longhorn", corev1.ReadWriteOnce, map[simharvester.Release]bool{simharvester.V1_6: true, simharvester.V1_7: true, simharvester.V1_8: true}},
		{"RWX Longhorn", "pvc-x", "longhorn", corev1.ReadWriteMany, map[simharvester.Release]bool{simharvester.V1_6: true, simharvester.V1_7: true, simharvester.V1_8: true}},
		{"RWX outside Longhorn", "pvc-x", "nfs", corev1.ReadWriteMany, map[simharvester.Release]bool{simharvester.V1_6: true}},
		{"RWO outside Longhorn", "pvc-x", "nfs", corev1.ReadWriteOnce, map[simharvester.Release]bool{simharvester.V1_6: true, simharvester.V1_7: true, simharvester.V1_8: true}},
		{"shareable disk of the holder", "pvc-x+shared", "longhorn", corev1.ReadWriteOnce, map[simharvester.Release]bool{simharvester.V1_6: true}},
		{"no such claim", "pvc-x", "", "", map[simharvester.Release]bool{simharvester.V1_6: true}},
	}
	for _, r := range releases {
		t.Run(string(r), func(t *testing.T) {
			f := start(t)
			f.serve(t, r)
			for i, tc := range cases {
				holder, taker := fmt.Sprintf("holder-%d", i), fmt.Sprintf("taker-%d", i)
				claim := fmt.Sprintf("pvc-x%d", i)
				if tc.class != "" {
					f.pvc(t, claim, tc.class, tc.mode)
				}
				// The sentinel, an RWO Longhorn claim of the holder too,
				// is refused in every release: once it is, the validator's
				// cache has the holder.
				sentinel := "sentinel-" + claim
				f.pvc(t, sentinel, "longhorn", corev1.ReadWriteOnce)
				entry := strings.Replace(tc.holder, "pvc-x", claim, 1)
				if err := f.createVM(holder, entry, sentinel); err != nil {
					t.Fatalf("%s: %v", tc.name, err)
				}
				if err := f.createVM(taker); err != nil {
					t.Fatal(err)
				}
				testwait.Until(f.ctx, t, "the holder in the validator's cache", func() (bool, string) {
					_, err := f.kv.KubevirtV1().VirtualMachines(f.ns).Create(f.ctx, vmObject(f.ns, "probe", sentinel), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
					return apierrors.IsInvalid(err), fmt.Sprint(err)
				})
				var err error
				err = f.setClaims(taker, claim)
				if tc.deniedSince[r] {
					wantDenied(t, tc.name, err, http.StatusUnprocessableEntity, occupiedMessage(r, f.ns, claim, holder))
				} else {
					wantAllowed(t, tc.name, err)
				}
			}
		})
	}
}

// The PVC validator refuses deleting a claim a VM template names (422 up to
// 1.7, 409 from 1.8) and lets it go once no template does.
func TestClaimDeleteRefusedWhileInATemplate(t *testing.T) {
	for _, r := range releases {
		t.Run(string(r), func(t *testing.T) {
			f := start(t)
			f.serve(t, r)
			f.pvc(t, "pvc-d", "longhorn", corev1.ReadWriteMany)
			if err := f.createVM("vm-d", "pvc-d"); err != nil {
				t.Fatal(err)
			}
			code := int32(http.StatusUnprocessableEntity)
			if r == simharvester.V1_8 {
				code = http.StatusConflict
			}
			msg := fmt.Sprintf("can not delete the volume pvc-d which is currently attached to VM: %s/vm-d", f.ns)
			var err error
			testwait.Until(f.ctx, t, "the deletion refused", func() (bool, string) {
				err = f.kube.CoreV1().PersistentVolumeClaims(f.ns).Delete(f.ctx, "pvc-d", metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
				return err != nil, "allowed"
			})
			wantDenied(t, "delete", err, code, msg)
			wantAllowed(t, "dropping the claim", f.setClaims("vm-d"))
			testwait.Until(f.ctx, t, "the deletion allowed", func() (bool, string) {
				err := f.kube.CoreV1().PersistentVolumeClaims(f.ns).Delete(f.ctx, "pvc-d", metav1.DeleteOptions{})
				return err == nil, fmt.Sprint(err)
			})
		})
	}
}

// Harvester's VM mutator gives a template without a termination grace
// period its 120 s default, and keeps one that is set.
func TestMutatorDefaultsTerminationGracePeriod(t *testing.T) {
	f := start(t)
	f.serve(t, simharvester.V1_8)
	vm := vmObject(f.ns, "vm-g")
	vm.Spec.Template.Spec.TerminationGracePeriodSeconds = nil
	got, err := f.kv.KubevirtV1().VirtualMachines(f.ns).Create(f.ctx, vm, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if g := got.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g != simharvester.DefaultTerminationGracePeriod {
		t.Errorf("termination grace period = %v, want %d", g, simharvester.DefaultTerminationGracePeriod)
	}
	got, err = f.kv.KubevirtV1().VirtualMachines(f.ns).Create(f.ctx, vmObject(f.ns, "vm-h"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if g := got.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g != 30 {
		t.Errorf("a set termination grace period became %v, want 30", g)
	}
}

// While the webhook service is away every VM write, status included, fails
// with the API server's "failed calling webhook" (500), and nothing is
// stored; once it is back the writes pass.
func TestOutage(t *testing.T) {
	f := start(t)
	f.serve(t, simharvester.V1_7)
	if err := f.createVM("vm-o"); err != nil {
		t.Fatal(err)
	}
	f.srv.Down()
	if !f.srv.IsDown() {
		t.Fatal("IsDown after Down is false")
	}
	for what, err := range map[string]error{"spec write": f.label("vm-o"), "status write": f.statusWrite("vm-o"), "create": f.createVM("vm-p")} {
		if !apierrors.IsInternalError(err) || !strings.Contains(err.Error(), `failed calling webhook "`+simharvester.ValidatorName+`"`) {
			t.Errorf("%s during the outage: %v, want an internal error naming the webhook", what, err)
		}
	}
	if _, err := f.kv.KubevirtV1().VirtualMachines(f.ns).Get(f.ctx, "vm-p", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("VM created during the outage: %v", err)
	}
	if err := f.srv.Up(); err != nil {
		t.Fatal(err)
	}
	wantAllowed(t, "spec write after the outage", f.label("vm-o"))
	wantAllowed(t, "status write after the outage", f.statusWrite("vm-o"))
}
