package kubevirtsim

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

func pvcVol(name, claim string, hot bool) kubevirtv1.Volume {
	return kubevirtv1.Volume{Name: name, VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}, Hotpluggable: hot,
	}}}
}

func addReq(name string) *kubevirtv1.VirtualMachineVolumeRequest {
	return &kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: addOpts(name, name, "scsi")}
}

func rmReq(name string) *kubevirtv1.VirtualMachineVolumeRequest {
	return &kubevirtv1.VirtualMachineVolumeRequest{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: name}}
}

func TestVerifyVolumeOption(t *testing.T) {
	vols := []kubevirtv1.Volume{
		{Name: "rootdisk", VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "x"}}},
		pvcVol("data", "claim-data", false),
		pvcVol("hot", "claim-hot", true),
	}
	cases := []struct {
		req  *kubevirtv1.VirtualMachineVolumeRequest
		want string
	}{
		{addReq("new"), ""},
		{addReq("hot"), "Unable to add volume [hot] because volume with that name already exists"},
		{&kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: addOpts("other", "claim-hot", "scsi")}, "Unable to add volume source [claim-hot] because it already exists"},
		{rmReq("hot"), ""},
		{rmReq("claim-hot"), ""}, // found by claim name too
		{rmReq("data"), "Unable to remove volume [data] because it is not hotpluggable"},
		{rmReq("rootdisk"), "Unable to remove volume [rootdisk] because it is not hotpluggable"},
		{rmReq("gone"), "Unable to remove volume [gone] because it does not exist"},
	}
	for _, c := range cases {
		err := verifyVolumeOption(vols, c.req)
		got := ""
		if err != nil {
			got = err.Error()
		}
		if got != c.want {
			t.Errorf("%s: got %q, want %q", requestName(c.req), got, c.want)
		}
	}
}

func TestQueueVolumeRequest(t *testing.T) {
	list := []kubevirtv1.VirtualMachineVolumeRequest{*addReq("a"), *rmReq("b")}
	for _, c := range []struct {
		req  *kubevirtv1.VirtualMachineVolumeRequest
		want string
		n    int
	}{
		{addReq("a"), "add volume request for volume [a] already exists", 0},
		{addReq("b"), "unable to add volume since a remove volume request for volume [b] already exists and is still being processed", 0},
		{rmReq("b"), "a remove volume request for volume [b] already exists and is still being processed", 0},
		{addReq("c"), "", 3},
		{rmReq("a"), "", 2}, // a queued remove replaces the queued add
	} {
		out, err := queueVolumeRequest(list, c.req)
		got := ""
		if err != nil {
			got = err.Error()
		}
		if got != c.want || (err == nil && len(out) != c.n) {
			t.Errorf("%s: got %q (%d entries), want %q (%d)", requestName(c.req), got, len(out), c.want, c.n)
		}
	}
	out, _ := queueVolumeRequest(list, rmReq("a"))
	if out[0].RemoveVolumeOptions == nil || out[0].RemoveVolumeOptions.Name != "b" || out[1].RemoveVolumeOptions.Name != "a" {
		t.Errorf("remove did not replace the add: %+v", out)
	}
}

func TestApplyAndTrim(t *testing.T) {
	spec := &kubevirtv1.VirtualMachineInstanceSpec{}
	applyVolumeRequest(spec, addReq("a"))
	applyVolumeRequest(spec, addReq("a")) // no duplicate
	if len(spec.Volumes) != 1 || len(spec.Domain.Devices.Disks) != 1 || !isHotpluggable(spec.Volumes[0]) || spec.Domain.Devices.Disks[0].Name != "a" {
		t.Fatalf("add: %+v", spec)
	}
	reqs := []kubevirtv1.VirtualMachineVolumeRequest{*addReq("a"), *addReq("b"), *rmReq("c"), *rmReq("a")}
	got := trimDoneVolumeRequests(reqs, spec)
	// add a is done; add b is not; remove c is done (absent); remove a is not.
	if len(got) != 2 || got[0].AddVolumeOptions.Name != "b" || got[1].RemoveVolumeOptions.Name != "a" {
		t.Errorf("trim: %+v", got)
	}
	applyVolumeRequest(spec, rmReq("a"))
	if len(spec.Volumes) != 0 || len(spec.Domain.Devices.Disks) != 0 {
		t.Errorf("remove: %+v", spec)
	}
}

func TestCASPatchShape(t *testing.T) {
	// Empty list: test null, then add; otherwise test the whole list and replace.
	p, _ := casPatch(casOp{"/status/volumeRequests", []kubevirtv1.VirtualMachineVolumeRequest(nil), []kubevirtv1.VirtualMachineVolumeRequest{*addReq("x")}, false})
	want := `[{"op":"test","path":"/status/volumeRequests","value":null},{"op":"add","path":"/status/volumeRequests","value":[{"addVolumeOptions":{"name":"x","disk":{"name":"","disk":{"bus":"scsi"}},"volumeSource":{"persistentVolumeClaim":{"claimName":"x"}}}}]}]`
	if string(p) != want {
		t.Errorf("got  %s\nwant %s", p, want)
	}
	var ops []map[string]any
	p, _ = casPatch(casOp{"/a", []int{1}, []int{1, 2}, true})
	_ = json.Unmarshal(p, &ops)
	if len(ops) != 2 || ops[0]["op"] != "test" || ops[1]["op"] != "replace" {
		t.Errorf("replace shape: %s", p)
	}
}

func TestNextTarget(t *testing.T) {
	used := map[string]bool{"sda": true, "vda": true}
	d := &kubevirtv1.Disk{DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: "scsi"}}}
	if got := nextTarget(d, used); got != "sdb" {
		t.Errorf("next scsi target %q", got)
	}
	d.Disk.Bus = "virtio"
	if got := nextTarget(d, used); got != "vdb" {
		t.Errorf("next virtio target %q", got)
	}
}

func TestOptionsDefaultsAndScale(t *testing.T) {
	o := Options{Scale: 0.5, Timings: Timings{Mount: -1, PodStart: 4 * time.Second}}
	if err := o.setDefaults(); err != nil {
		t.Fatal(err)
	}
	if o.Timings.PodStart != 2*time.Second || o.Timings.Mount != 0 || o.Timings.DomainAttach != 750*time.Millisecond || o.Timings.Snapshot != 500*time.Millisecond {
		t.Errorf("timings %+v", o.Timings)
	}
	if o.Mode != ModeLegacy || o.Version != V1_7_0 || o.StorageClass != "longhorn" || o.ServerVersion != "v1.8.0" {
		t.Errorf("defaults %+v", o)
	}
	bad := Options{Mode: ModeDeclarative, Version: V1_5_3}
	if err := bad.setDefaults(); err == nil || err.Error() != "kubevirtsim: KubeVirt v1.5.3 has no DeclarativeHotplugVolumes gate" {
		t.Errorf("declarative on v1.5.3: %v", err)
	}
	for _, name := range []string{"v1.4.0", "1.7", ""} {
		if _, err := ParseVersion(name); err == nil {
			t.Errorf("version %q accepted", name)
		}
	}
	for _, v := range Versions() {
		if got, err := ParseVersion(strings.TrimPrefix(string(v), "v")); err != nil || got != v {
			t.Errorf("ParseVersion(%q) = %q, %v", v, got, err)
		}
	}
	j := newJitterer(1, 0.25)
	for range 100 {
		if d := j.d(time.Second); d < 750*time.Millisecond || d > 1250*time.Millisecond {
			t.Fatalf("jitter out of range: %v", d)
		}
	}
}

func TestParseRequest(t *testing.T) {
	for path, want := range map[string]reqInfo{
		"PATCH /apis/kubevirt.io/v1/namespaces/ns/virtualmachines/vm":                                 {RequestKey{"patch", "kubevirt.io", "virtualmachines", ""}, "ns", "vm"},
		"PUT /apis/kubevirt.io/v1/namespaces/ns/virtualmachines/vm/status":                            {RequestKey{"update", "kubevirt.io", "virtualmachines", "status"}, "ns", "vm"},
		"PUT /apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/vm/addvolume":            {RequestKey{"update", "subresources.kubevirt.io", "virtualmachines", "addvolume"}, "ns", "vm"},
		"GET /apis/kubevirt.io/v1/namespaces/ns/virtualmachineinstances?watch=true":                   {RequestKey{"watch", "kubevirt.io", "virtualmachineinstances", ""}, "ns", ""},
		"GET /api/v1/namespaces/ns/persistentvolumeclaims/c":                                          {RequestKey{"get", "", "persistentvolumeclaims", ""}, "ns", "c"},
		"GET /api/v1/namespaces/ns":                                                                   {RequestKey{"get", "", "namespaces", ""}, "ns", "ns"},
		"DELETE /apis/kubevirt.io/v1/namespaces/ns/virtualmachines":                                   {RequestKey{"deletecollection", "kubevirt.io", "virtualmachines", ""}, "ns", ""},
		"GET /apis/harvesterhci.io/v1beta1/settings/server-version":                                   {RequestKey{"get", "harvesterhci.io", "settings", ""}, "", "server-version"},
		"PUT /apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/removevolume": {RequestKey{"update", "subresources.kubevirt.io", "virtualmachineinstances", "removevolume"}, "ns", "vm"},
	} {
		var method, url string
		for i := range path {
			if path[i] == ' ' {
				method, url = path[:i], path[i+1:]
				break
			}
		}
		got := parseRequest(httptest.NewRequest(method, url, nil))
		if got != want {
			t.Errorf("%s: got %+v, want %+v", path, got, want)
		}
	}
}

// A pass of the VM or VMI controller or virt-handler that keeps failing with
// nothing else happening to its object is retried after client-go's default
// controller backoff, 5 ms doubling up to 1000 s, as KubeVirt's are: after
// 20 failures the next retry waits far longer than a second.
func TestFailedPassesBackOffAsKubeVirtsControllers(t *testing.T) {
	c := &cluster{t: defaultTimings(t, Options{})}
	for name, q := range map[string]workQueue{
		"VM controller":  newVMController(c, nil).queue,
		"VMI controller": newVMIController(c, nil).queue,
		"virt-handler":   newVirtHandler(c, nil).queue,
	} {
		var wait time.Duration
		for range 20 {
			wait = q.limiter.When("ns/vm")
		}
		if wait < 10*time.Minute || wait > 1000*time.Second {
			t.Errorf("%s: retry after 20 failed passes waits %v, want 5 ms doubling (to 1000 s)", name, wait)
		}
		q.ShutDown()
	}
}

// sendCheck is a ResponseWriter that runs check before it sends anything.
type sendCheck struct {
	*httptest.ResponseRecorder
	check func(what string, b []byte)
}

func (s *sendCheck) WriteHeader(code int) {
	if code < http.StatusOK {
		return // an informational answer goes ahead of the real one
	}
	s.check("header", nil)
	s.ResponseRecorder.WriteHeader(code)
}

func (s *sendCheck) Write(b []byte) (int, error) {
	s.check("body", b)
	return s.ResponseRecorder.Write(b)
}

// TestAnswerIsCountedBeforeItGoesOut: the front proxy counts an answer, and
// a webhook's denial, before the bytes that carry it leave, so a client
// that has read the answer finds it in Stats (counting once the handler had
// returned raced with the client's next look).
func TestAnswerIsCountedBeforeItGoesOut(t *testing.T) {
	var answered, denied []int
	out := &sendCheck{ResponseRecorder: httptest.NewRecorder()}
	rec := &statusRecorder{ResponseWriter: out,
		answered: func(code int) { answered = append(answered, code) },
		denied:   func(code int) { denied = append(denied, code) }}
	out.check = func(what string, b []byte) {
		if len(answered) == 0 {
			t.Errorf("the %s went out before the answer was counted", what)
		}
		if bytes.Contains(b, []byte("denied the request")) && len(denied) == 0 {
			t.Errorf("the denial went out before it was counted")
		}
	}
	body := []byte(`{"kind":"Status","code":422,"message":"admission webhook \"v.kubevirt.io\" denied the request: no"}`)
	rec.WriteHeader(http.StatusContinue) // informational: not the answer
	if len(answered) != 0 {
		t.Fatalf("a 1xx was counted as the answer: %v", answered)
	}
	rec.WriteHeader(http.StatusUnprocessableEntity)
	for _, part := range [][]byte{body[:40], body[40:]} {
		if _, err := rec.Write(part); err != nil {
			t.Fatal(err)
		}
	}
	rec.setCode(http.StatusOK) // what ServeHTTP does when the handler returns
	if !slices.Equal(answered, []int{422}) || !slices.Equal(denied, []int{422}) {
		t.Errorf("answers %v, denials %v: want one 422 each", answered, denied)
	}
}
