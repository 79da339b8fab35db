-- wrk script for bench/intake.py: one deletion request per call, each with its own subject, sample id and
-- Idempotency-Key, so the in-flight index never answers 409 and no request replays another.
-- Arguments (after `--`): path model_id api_key run_tag first_row id_file
-- Counts every status per thread; with an id_file, writes the id of every 202 (one per line) for the database check.

-- globals, not locals: done() reads them from each thread with thread:get
path, model_id, api_key, tag, first_row, id_file = nil, nil, nil, nil, 0, ""
counter = 0
counts = {}
ids = {}
local threads = {}

function setup(thread)
   thread:set("tid", #threads)
   table.insert(threads, thread)
end

function init(args)
   path, model_id, api_key, tag = args[1], args[2], args[3], args[4]
   first_row, id_file = tonumber(args[5]), args[6]
   nthreads = tonumber(args[7] or "1")
   counter = tid
end

function request()
   local row = first_row + counter
   local key = tag .. "-" .. counter
   counter = counter + nthreads
   local body = '{"subject_ref":"subject-' .. key .. '","model_id":"' .. model_id ..
      '","scope":{"kind":"samples","sample_ids":["r' .. row .. '"]}}'
   return wrk.format("POST", path, {
      ["Content-Type"] = "application/json",
      ["Authorization"] = "Bearer " .. api_key,
      ["Idempotency-Key"] = key,
   }, body)
end

function response(status, headers, body)
   counts[status] = (counts[status] or 0) + 1
   if status == 202 and id_file ~= "" then
      local id = string.match(body, '"id":"([^"]+)"')
      if id then ids[#ids + 1] = id end
   end
end

function done(summary, latency, requests)
   local total = {}
   for _, thread in ipairs(threads) do
      for status, n in pairs(thread:get("counts")) do total[status] = (total[status] or 0) + n end
   end
   local file = nil
   local id_path = threads[1] and threads[1]:get("id_file") or ""
   if id_path ~= "" then
      file = io.open(id_path, "w")
      for _, thread in ipairs(threads) do
         for _, id in ipairs(thread:get("ids")) do file:write(id, "\n") end
      end
      file:close()
   end
   local parts = {}
   for status, n in pairs(total) do parts[#parts + 1] = '"' .. status .. '":' .. n end
   local e = summary.errors
   io.write(string.format(
      'WRK_RESULT {"requests":%d,"duration_us":%d,"bytes":%d,"statuses":{%s},' ..
      '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
      '"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f}\n',
      summary.requests, summary.duration, summary.bytes, table.concat(parts, ","),
      e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
