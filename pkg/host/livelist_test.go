package host

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"testing"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// liveListServer serves the namespace "guests" of vms and vmis, and fails
// the test on a list that names a resourceVersion: the fence needs a read
// that includes every write made before it, which only a quorum read is.
func liveListServer(t *testing.T, vms *kubevirtv1.VirtualMachineList, vmis *kubevirtv1.VirtualMachineInstanceList) *Client {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body runtime.Object
		switch r.URL.Path {
		case "/apis/kubevirt.io/v1/namespaces/guests/virtualmachines":
			body = vms
		case "/apis/kubevirt.io/v1/namespaces/guests/virtualmachineinstances":
			body = vmis
		default:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			_ = json.NewEncoder(w).Encode(&metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
				Status: metav1.StatusFailure, Reason: metav1.StatusReasonNotFound, Code: http.StatusNotFound, Message: "the server could not find the requested resource"})
			return
		}
		if rv := r.URL.Query().Get("resourceVersion"); rv != "" {
			t.Errorf("%s listed with resourceVersion %q: a quorum read has none", r.URL.Path, rv)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(body)
	}))
	t.Cleanup(srv.Close)
	c, err := NewForConfig(&rest.Config{Host: srv.URL}, "guests")
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// The live lists are quorum reads whose objects hold, of everything a
// Harvester VM and VMI carry, exactly the fields of the live lists' types,
// with the values a full decode gives them.
func TestLiveListsAreQuorumReadsOfTheHolderFields(t *testing.T) {
	vm, other := fixtureVM(3), fixtureVM(0)
	other.Name, other.Spec.Template = "guest-worker-2", nil
	vmi := fixtureVMI(3)
	c := liveListServer(t, &kubevirtv1.VirtualMachineList{Items: []kubevirtv1.VirtualMachine{*vm, *other}},
		&kubevirtv1.VirtualMachineInstanceList{Items: []kubevirtv1.VirtualMachineInstance{*vmi}})
	kept := holdersKeptFields(t)
	ctx := context.Background()

	vms, err := c.LiveVMs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(vms) != 2 {
		t.Fatalf("%d VMs, want 2", len(vms))
	}
	for i, full := range []*kubevirtv1.VirtualMachine{vm, other} {
		want := full.DeepCopy()
		prune(reflect.ValueOf(want), kept)
		want.Namespace = "guests"
		if !equality.Semantic.DeepEqual(&vms[i], want) {
			t.Errorf("VM %s differs (- live, + full):\n%s", full.Name, jsonDiff(t, &vms[i], want))
		}
	}
	if len(vms[0].Status.VolumeRequests) == 0 || vms[0].Spec.Template == nil || vms[1].Spec.Template != nil {
		t.Errorf("the fixtures lost what they test: requests %v, templates %v and %v", vms[0].Status.VolumeRequests, vms[0].Spec.Template, vms[1].Spec.Template)
	}

	vmis, err := c.LiveVMIs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := vmi.DeepCopy()
	prune(reflect.ValueOf(want), kept)
	want.Namespace = "guests"
	if len(vmis) != 1 || !equality.Semantic.DeepEqual(&vmis[0], want) {
		t.Fatalf("VMIs differ (- live, + full):\n%s", jsonDiff(t, vmis, []kubevirtv1.VirtualMachineInstance{*want}))
	}
	if len(vmis[0].Status.VolumeStatus) == 0 || vmis[0].Status.VolumeStatus[0].Name == "" {
		t.Errorf("volume status lost: %+v", vmis[0].Status.VolumeStatus)
	}
}

// An error answer keeps its meaning for the caller.
func TestLiveListErrorKeepsItsCode(t *testing.T) {
	c := liveListServer(t, &kubevirtv1.VirtualMachineList{}, &kubevirtv1.VirtualMachineInstanceList{})
	c.Namespace = "elsewhere"
	if _, err := c.LiveVMs(context.Background()); !apierrors.IsNotFound(err) {
		t.Errorf("VMs of a namespace the server does not serve: %v, want NotFound", err)
	}
}

// BenchmarkDecodeLiveVMIList decodes the list the holder check reads before
// an attach batch, 50 VMIs with 20 hot-plugged volumes each, in full, as
// the informers' lean types, and as the live list does.
func BenchmarkDecodeLiveVMIList(b *testing.B) {
	full := &kubevirtv1.VirtualMachineInstanceList{}
	for i := range 50 {
		v := fixtureVMI(20)
		v.Name = fmt.Sprintf("guest-worker-%d", i)
		full.Items = append(full.Items, *v)
	}
	raw, err := json.Marshal(full)
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		decode func() error
	}{
		{"full", func() error {
			_, _, err := fullSerializer().SupportedMediaTypes()[0].Serializer.Decode(raw, nil, &kubevirtv1.VirtualMachineInstanceList{})
			return err
		}},
		{"lean", func() error {
			_, _, err := leanCodec{res: leanVMIs()}.Decode(raw, nil, &kubevirtv1.VirtualMachineInstanceList{})
			return err
		}},
		{"live", func() error {
			var l struct {
				Items []holdersVMI `json:"items"`
			}
			if err := json.Unmarshal(raw, &l); err != nil {
				return err
			}
			out := make([]kubevirtv1.VirtualMachineInstance, len(l.Items))
			for i := range l.Items {
				l.Items[i].fill(&out[i])
			}
			return nil
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(raw)))
			b.ReportAllocs()
			for range b.N {
				if err := c.decode(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
