package host

import (
	"context"
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// kubevirtCRD serves a kubevirt.io/v1 kind without a schema, so objects
// keep every field the fixtures give them.
func kubevirtCRD(plural, singular, kind string) *apiextv1.CustomResourceDefinition {
	return &apiextv1.CustomResourceDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: plural + ".kubevirt.io"},
		Spec: apiextv1.CustomResourceDefinitionSpec{
			Group: "kubevirt.io", Scope: apiextv1.NamespaceScoped,
			Names: apiextv1.CustomResourceDefinitionNames{Plural: plural, Singular: singular, Kind: kind, ListKind: kind + "List"},
			Versions: []apiextv1.CustomResourceDefinitionVersion{{Name: "v1", Served: true, Storage: true,
				Schema: &apiextv1.CustomResourceValidation{OpenAPIV3Schema: &apiextv1.JSONSchemaProps{Type: "object", XPreserveUnknownFields: ptr.To(true)}}}},
		},
	}
}

// The informers list and watch through the lean decoder on a real API
// server: what they cache is the live object with only the kept fields,
// before and after an update, and a deletion leaves the cache.
func TestLeanInformersListAndWatch(t *testing.T) {
	if testing.Short() {
		t.Skip("needs an API server")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	env, err := testenv.Start(ctx, testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	ext, err := apiextclient.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	if err := testenv.InstallCRDs(ctx, ext, []*apiextv1.CustomResourceDefinition{
		kubevirtCRD("virtualmachines", "virtualmachine", "VirtualMachine"),
		kubevirtCRD("virtualmachineinstances", "virtualmachineinstance", "VirtualMachineInstance"),
	}); err != nil {
		t.Fatal(err)
	}
	kube := kubernetes.NewForConfigOrDie(env.Config)
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "guests"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kv, err := kubevirt.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	vmis, vms := kv.KubevirtV1().VirtualMachineInstances("guests"), kv.KubevirtV1().VirtualMachines("guests")
	create := func(obj metav1.Object) {
		obj.SetUID("")
		obj.SetResourceVersion("")
		obj.SetManagedFields(nil)
		obj.SetFinalizers(nil)
		var err error
		switch o := obj.(type) {
		case *kubevirtv1.VirtualMachineInstance:
			_, err = vmis.Create(ctx, o, metav1.CreateOptions{})
		case *kubevirtv1.VirtualMachine:
			_, err = vms.Create(ctx, o, metav1.CreateOptions{})
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	// One VMI exists before the informer lists, one arrives by its watch.
	vmi := fixtureVMI(3)
	vmi.OwnerReferences = nil
	create(vmi)

	c, err := NewForConfig(env.Config, "guests")
	if err != nil {
		t.Fatal(err)
	}
	vmiInf, vmInf := c.VMIInformer(0), c.VMInformer(0)
	go vmiInf.RunWithContext(ctx)
	go vmInf.RunWithContext(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), vmiInf.HasSynced, vmInf.HasSynced) {
		t.Fatal("informers did not sync")
	}
	kept := keptFields(t)
	// cachedIsLean says whether the cache holds the live object's kept
	// fields, and nothing else.
	cachedIsLean := func(store cache.Store, live runtime.Object) (bool, string) {
		m := live.(metav1.Object)
		got, ok, _ := store.GetByKey("guests/" + m.GetName())
		if !ok {
			return false, "not cached"
		}
		want := live.DeepCopyObject()
		prune(reflect.ValueOf(want), kept)
		delete(want.(metav1.Object).GetAnnotations(), lastApplied)
		if !equality.Semantic.DeepEqual(got, want) {
			return false, "cached " + jsonDiff(t, got, want)
		}
		return true, ""
	}
	liveVMI := func() runtime.Object {
		got, err := vmis.Get(ctx, "guest-worker-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	// Each wait is for the live object as read once after the last write:
	// its resourceVersion is among the kept fields.
	within := func(what string, cond func() (bool, string)) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		testwait.Until(wctx, t, what, cond)
	}
	live := liveVMI()
	within("the listed VMI cached lean", func() (bool, string) { return cachedIsLean(vmiInf.GetStore(), live) })

	// virt-handler reports the last volume attached.
	cur := liveVMI().(*kubevirtv1.VirtualMachineInstance)
	last := &cur.Status.VolumeStatus[len(cur.Status.VolumeStatus)-1]
	last.Phase, last.Target, last.Reason, last.Message = kubevirtv1.VolumeReady, "sdc", "VolumeReady", "Successfully attach hotplugged volume"
	last.HotplugVolume.AttachPodUID = "0c1d2e3f-4a5b-4c6d-8e7f-9a0b1c2d3e4f"
	updated, err := vmis.Update(ctx, cur, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	within("the VMI's update cached lean", func() (bool, string) { return cachedIsLean(vmiInf.GetStore(), updated) })
	got, _, _ := vmiInf.GetStore().GetByKey("guests/guest-worker-1")
	if st := got.(*kubevirtv1.VirtualMachineInstance).Status.VolumeStatus; st[len(st)-1].Target != "sdc" {
		t.Errorf("cached volume status %+v, want the last one attached as sdc", st[len(st)-1])
	}

	vm := fixtureVM(3)
	create(vm)
	liveVM, err := vms.Get(ctx, vm.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	within("the watched VM cached lean", func() (bool, string) { return cachedIsLean(vmInf.GetStore(), liveVM) })

	if err := vmis.Delete(ctx, "guest-worker-1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	within("the deleted VMI gone from the cache", testwait.Bool(func() bool {
		_, ok, _ := vmiInf.GetStore().GetByKey("guests/guest-worker-1")
		return !ok
	}))
}
